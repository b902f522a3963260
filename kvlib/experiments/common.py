"""What the engine-based experiments share: a model cache, one run per point, and flattening a result to a row."""

from __future__ import annotations

import functools

from kvlib.backends import BACKENDS, runner_settings
from kvlib.backends.vllm import check_weights
from kvlib.engine import Engine
from kvlib.models import LoadedModel, load_model
from kvlib.policies import make_policy
from kvlib.random_weights import CAVEAT
from kvlib.run_result import RunResult


@functools.lru_cache(maxsize=2)
def model(name: str, device: str | None = None, weights: str = "pretrained") -> LoadedModel:
    return load_model(name, device=device, weights=weights)


def weights_of(point: dict) -> str:
    return point.get("weights", "pretrained")


def model_of(point: dict) -> LoadedModel:
    return model(point["model"], point.get("device"), weights_of(point))


def settings_of(point: dict) -> dict:
    """The point's policy settings: the profile's, then any grid axis named after one of them (e.g. `budget`)."""
    own = runner_settings(point["policy"])
    return {**point["policy_settings"], **{k: point[k] for k in own if k in point}}


def capacity_bytes(point: dict) -> int | None:
    capacity = point.get("device_capacity_gb")
    return int(capacity * 2**30) if capacity else None


def make_engine(point: dict) -> Engine:
    loaded = model_of(point)
    policy = make_policy(point["policy"], **settings_of(point))
    return Engine(loaded, policy, device_capacity_bytes=capacity_bytes(point))


def run(point: dict, prompts: list[list[int]], max_new_tokens: int, prefill: str | None = None,
        chunk_size: int = 512) -> RunResult:
    """One generation run of the point's policy on the given prompts (ignoring EOS, so lengths are as asked).

    Without a prefill mode, the policy's preferred one (fused, or chunked for H2O, which needs scores). An outside
    backend (the real vLLM) runs the same prompts its own way."""
    if point["policy"] in BACKENDS:
        check_weights(point["model"], weights_of(point))
        backend = BACKENDS[point["policy"]](**settings_of(point))
        return backend.generate(point["model"], prompts, max_new_tokens, stop_at_eos=False,
                                device_capacity_bytes=capacity_bytes(point))
    engine = make_engine(point)
    mode = prefill or engine.policy.preferred_prefill
    if engine.model.device.type == "cuda":
        # a GPU pays for its first call of each kernel (library handles, kernel selection): without an untimed run
        # first, a smoke run on an H100 measured 0.4-1.5 s TTFT for prompts whose neighbours took 0.02-0.05 s.
        # A separate engine, so the warm-up leaves nothing in the measured run's ledger.
        make_engine(point).generate(prompts[:1], 1, prefill_mode=mode, chunk_size=chunk_size, stop_at_eos=False)
    return engine.generate(prompts, max_new_tokens, prefill_mode=mode, chunk_size=chunk_size, stop_at_eos=False)


def result_row(result: RunResult, point: dict | None = None) -> dict:
    """The tidy columns every experiment stores: timings (every timer section, every decode step), memory by tier and
    component, OOM, the KV share the policy attended, policy stats."""
    m = result.metrics
    row = {"policy": result.policy["name"]}  # what ran: "vllm (real)" for the outside baseline
    if point is not None and weights_of(point) == "random":
        row["caveat"] = CAVEAT
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
