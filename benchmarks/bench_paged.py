"""Decode throughput of kvlib `paged` vs transformers `generate` (padded batch) vs transformers `generate_batch`
(its own paged continuous batching; transformers 5.23 needs no "paged|" prefix for it), on the embedded model, batch 1 / 8 / 16,
prompts of mixed lengths 128-2048, all in one process. Writes benchmarks/results/paged.json.

Decode throughput = generated tokens after the first, divided by the time from the first token of the batch to the
last (a logits processor timestamps transformers' steps; kvlib's engine measures its own decode loop).
"""

from __future__ import annotations

import json
import time

import torch
from hf_baseline import hf_generate
from smoke import results_path, sized
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

from kvlib.engine import Engine
from kvlib.engine.scheduler import RunSettings, Sequence
from kvlib.models import load_model, resolve_model_path
from kvlib.models.workloads import mixed_length_prompts
from kvlib.policies import make_policy

OUT = results_path("paged.json")
NEW_TOKENS = sized(24, 4)


def hf_generate_batch(model, prompts) -> dict:
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=-1)
    # transformers sizes its cache from the device's free memory, on a CPU 90 % of the machine's (21 GB at the smoke
    # size's 64 tokens), and every step's attention mask spans the whole cache: sized instead, as kvlib's pool is,
    # to the batch's tokens
    pages = ContinuousBatchingConfig().page_size
    blocks = sum(-(-(len(p) + NEW_TOKENS) // pages) for p in prompts)
    start = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=config, record_timestamps=True,
                               continuous_batching_config=ContinuousBatchingConfig(num_blocks=blocks))
    end = time.perf_counter()
    failed = [k for k, o in out.items() if getattr(o, "error", None) or not o.generated_tokens]
    if failed:
        raise RuntimeError(f"generate_batch failed for {len(failed)} of {len(out)} requests")
    firsts = [o.timestamps[0] for o in out.values() if getattr(o, "timestamps", None)]
    first = min(firsts) if firsts else start
    tokens = sum(len(o.generated_tokens) - 1 for o in out.values())
    return {"decode_tokens_per_s": tokens / (end - first) if end > first else None, "generated_tokens": tokens}


def main() -> None:
    kv = load_model("smollm2-135m", device="cpu")
    path = resolve_model_path("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    Engine(kv, make_policy("paged")).generate([list(range(100, 200))], 4)  # warm-up, as transformers gets one
    hf_generate(hf, kv.tokenizer, [list(range(100, 200))], 4)
    rows = []
    for batch in sized((1, 8, 16), (2,)):
        prompts = mixed_length_prompts(kv.tokenizer, batch, *sized((128, 2048), (16, 48)), seed=batch)
        static = Engine(kv, make_policy("paged")).generate(prompts, NEW_TOKENS, stop_at_eos=False)
        continuous = Engine(kv, make_policy("paged")).run([Sequence(p, NEW_TOKENS) for p in prompts],
                                                          RunSettings("continuous", "chunked", stop_at_eos=False))
        row = {"batch": batch, "prompt_tokens": [len(p) for p in prompts],
               "kvlib_paged_static": static.metrics["decode_tokens_per_s"],
               "kvlib_paged_continuous": continuous.metrics["decode_tokens_per_s"],
               "kvlib_paged_continuous_total_s": continuous.metrics["total_s"]}
        row["hf_generate"] = hf_generate(hf, kv.tokenizer, prompts, NEW_TOKENS)["decode_tokens_per_s"]
        try:
            row["hf_generate_batch"] = hf_generate_batch(hf, prompts)["decode_tokens_per_s"]
        except Exception as exc:  # noqa: BLE001 -- report, do not hide, why transformers' paged path did not run here
            row["hf_generate_batch"] = None
            row["hf_generate_batch_error"] = f"{type(exc).__name__}: {exc}"[:300]
        row["ratio_paged_vs_generate"] = row["kvlib_paged_static"] / row["hf_generate"]
        if row["hf_generate_batch"]:
            row["ratio_paged_vs_generate_batch"] = row["kvlib_paged_static"] / row["hf_generate_batch"]
        rows.append(row)
        print(row, flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"device": "cpu", "threads": torch.get_num_threads(), "new_tokens": NEW_TOKENS,
                               "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
