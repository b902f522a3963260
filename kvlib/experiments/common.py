"""What the engine-based experiments share: a model cache, one run per point, and flattening a result to a row."""

from __future__ import annotations

import functools

from kvlib.engine import Engine
from kvlib.models import LoadedModel, load_model
from kvlib.policies import make_policy
from kvlib.profile import Point
from kvlib.random_weights import CAVEAT, check_experiment
from kvlib.run_result import RunResult
from kvlib.runners import make_runner
from kvlib.workloads import calibration_prompt


@functools.lru_cache(maxsize=2)
def model(name: str, device: str | None = None, weights: str = "pretrained") -> LoadedModel:
    return load_model(name, device=device, weights=weights)


def model_of(point: Point) -> LoadedModel:
    check_experiment(point.experiment, point.weights)
    return model(point.model, point.device, point.weights)


def make_engine(point: Point) -> Engine:
    """The engine for a kvlib policy's point. A policy that calibrates (InfiniGen) does so on the profile's text
    (`calibration_source` among an experiment's fixed values; the CPython docs by default)."""
    loaded = model_of(point)
    return Engine(loaded, make_policy(point.runner, **point.settings), device_capacity_bytes=point.capacity_bytes,
                  calibration=calibration_prompt(loaded, point.values.get("calibration_source")))


def run(point: Point, prompts: list[list[int]], max_new_tokens: int) -> RunResult:
    """One generation run of the point's runner on the given prompts (ignoring EOS, so lengths are as asked), with
    the point's prefill mode, or the runner's preferred one. An outside engine (the real vLLM) runs the same prompts
    its own way."""
    runner = make_runner(point.runner, **point.settings)
    if runner.outside:
        return runner.generate(point.model, prompts, max_new_tokens, stop_at_eos=False,
                               device_capacity_bytes=point.capacity_bytes, weights=point.weights)
    engine = make_engine(point)
    mode = point.values.get("prefill", runner.preferred_prefill)
    chunk_size = point.values.get("chunk_size", 512)
    if engine.model.device.type == "cuda":
        # a GPU pays for its first call of each kernel (library handles, kernel selection): without an untimed run
        # first, a smoke run on an H100 measured 0.4-1.5 s TTFT for prompts whose neighbours took 0.02-0.05 s.
        # A separate engine, so the warm-up leaves nothing in the measured run's ledger.
        make_engine(point).generate(prompts[:1], 1, prefill_mode=mode, chunk_size=chunk_size, stop_at_eos=False)
    return engine.generate(prompts, max_new_tokens, prefill_mode=mode, chunk_size=chunk_size, stop_at_eos=False)


def result_row(result: RunResult, point: Point) -> dict:
    """The tidy columns every experiment stores: timings (every timer section, every decode step), memory by tier and
    component, OOM, the KV share the policy attended, policy stats."""
    m = result.metrics
    row = {"caveat": CAVEAT} if point.weights == "random" else {}
    row.update({k: m.get(k) for k in ("ttft_s", "setup_s", "prefill_s", "decode_s", "total_s", "decode_tokens",
                                      "decode_tokens_per_s", "decode_tokens_per_s_q1", "decode_tokens_per_s_q3",
                                      "decode_step_s_mean", "decode_step_s_p50", "decode_steps", "completed",
                                      "preemptions")})
    row["step_latencies_s"] = m.get("step_latencies_s")
    row.update({f"split_{k}_s": v for k, v in m.get("wall_split_s", {}).items()})
    row.update({f"section_{k.replace('.', '_')}_s": v for k, v in (m.get("sections_s") or {}).items()})
    for tier in ("device", "host"):
        mem = result.memory.get(tier, {})
        row[f"{tier}_peak_bytes"] = mem.get("peak_bytes")
        for comp, value in mem.get("peak_components", {}).items():
            row[f"{tier}_{comp}_peak_bytes"] = value
        row[f"{tier}_kv_bytes"] = mem.get("kv_bytes")
    row["oom"] = result.oom is not None
    row["oom_where"] = result.oom["where"] if result.oom else None
    for key, value in result.stats.items():
        if isinstance(value, (int, float, str, bool, list)) or value is None:
            row[f"stat_{key}"] = value
    return row
