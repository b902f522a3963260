"""kvlib's engine (full policy) vs transformers `generate` on the same prompts, side by side in one process.

Writes decode-throughput and TTFT ratios to benchmarks/results/engine.json. Batch 1 and batch 8 (mixed lengths).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from kvlib.engine import Engine
from kvlib.models import load_model
from kvlib.policies import make_policy
from kvlib.workloads import mixed_length_prompts

NEW_TOKENS = 32
OUT = Path(__file__).parent / "results" / "engine.json"


def hf_generate(model, prompts, max_new_tokens, repeats: int = 2) -> float:
    """Seconds (best of `repeats`) for a padded-batch greedy generate of exactly max_new_tokens tokens per prompt."""
    return min(_hf_generate_once(model, prompts, max_new_tokens) for _ in range(repeats))


def _hf_generate_once(model, prompts, max_new_tokens) -> float:
    tok = model.tokenizer
    width = max(map(len, prompts))
    pad = tok.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    model.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    return time.perf_counter() - start


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kv = load_model("smollm2-135m", device="cpu")
    hf = load_model("smollm2-135m", device="cpu")
    hf.model.config._attn_implementation = "sdpa"
    rows = []
    for batch in (1, 8):
        prompts = mixed_length_prompts(kv.tokenizer, batch, 128, 1024, seed=batch)
        hf_generate(hf, prompts[:1], 2)  # warm-up
        hf_ttft = hf_generate(hf, prompts, 1)
        hf_total = hf_generate(hf, prompts, NEW_TOKENS)
        hf_decode_tps = batch * (NEW_TOKENS - 1) / (hf_total - hf_ttft)
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
