"""kvlib's engine (full policy) vs transformers `generate` on the same prompts, side by side in one process.

Writes decode-throughput and TTFT ratios to benchmarks/results/engine.json. Batch 1 and batch 8 (mixed lengths).
"""

from __future__ import annotations

import json
import os

import torch
from hf_baseline import best_of, hf_generate
from smoke import results_path, sized

from kvlib.engine import Engine
from kvlib.models import load_model
from kvlib.models.workloads import mixed_length_prompts
from kvlib.policies import make_policy

NEW_TOKENS = sized(32, 4)
OUT = results_path("engine.json")


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kv = load_model("smollm2-135m", device="cpu")
    hf = load_model("smollm2-135m", device="cpu")
    hf.model.config._attn_implementation = "sdpa"
    rows = []
    for batch in sized((1, 8), (2,)):
        prompts = mixed_length_prompts(kv.tokenizer, batch, *sized((128, 1024), (16, 32)), seed=batch)
        hf_generate(hf.model, hf.tokenizer, prompts[:1], 2)  # warm-up
        base = best_of([hf_generate(hf.model, hf.tokenizer, prompts, NEW_TOKENS) for _ in range(2)])
        hf_ttft, hf_decode_tps = base["all_first_tokens_s"], base["decode_tokens_per_s"]
        Engine(kv, make_policy("full")).generate(prompts[:1], 2)  # warm-up, as for generate
        runs = [Engine(kv, make_policy("full")).generate(prompts, NEW_TOKENS, prefill_mode="fused", stop_at_eos=False)
                for _ in range(2)]
        m = {key: min(r.metrics[key] for r in runs) for key in ("prefill_s", "ttft_s")}
        m["decode_tokens_per_s"] = max(r.metrics["decode_tokens_per_s"] for r in runs)  # best of 2, as for generate
        rows.append({
            "batch": batch, "prompt_tokens": [len(p) for p in prompts], "new_tokens": NEW_TOKENS,
            "kvlib_decode_tokens_per_s": m["decode_tokens_per_s"], "hf_decode_tokens_per_s": hf_decode_tps,
            "decode_throughput_ratio": m["decode_tokens_per_s"] / hf_decode_tps,
            # generate prefills the padded batch in one pass; the engine prefills prompt by prompt, so compare
            # the time until every request has its first token
            "kvlib_all_first_tokens_s": m["prefill_s"], "hf_all_first_tokens_s": hf_ttft,
            "ttft_ratio_hf_over_kvlib": hf_ttft / m["prefill_s"],
            "kvlib_ttft_mean_s": m["ttft_s"],
        })
        print(rows[-1])
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"device": "cpu", "threads": torch.get_num_threads(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
