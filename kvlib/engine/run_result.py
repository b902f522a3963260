"""What a run reports, and the one function that builds its metrics: kvlib's engine and outside backends (the real
vLLM) alike, so every figure of the book is computed by the same rule whoever produced it.

What is not measured is None, never 0: a backend that cannot split its wall time reports no cache-operations time.
"""

from __future__ import annotations

import collections
import itertools
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from kvlib.errors import DeviceOOM

# The timer sections that are cache operations (book/methods.md): work a policy does to manage its cache, as opposed
# to computing the model. Attention over what a policy keeps is compute, whoever computes it.
CACHE_OPS = ("block_management", "fork", "eviction", "selection", "fetch", "offload")
# sections that are no cache operation, counted in their phase's time: allocation, the model's compute, and the wait
# for a layer's weights that a placement streams (FlexGen's; kvlib.models.offloaded_weights), a cost of the placement
PHASE_SECTIONS = ("allocate", "compute", "weights_wait")


@dataclass
class RunResult:
    outputs: list[dict]
    metrics: dict
    memory: dict
    policy: dict
    oom: dict | None = None
    stats: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"outputs": self.outputs, "metrics": self.metrics, "memory": self.memory, "policy": self.policy,
                "oom": self.oom, "policy_stats": self.stats}

    def row(self) -> dict:
        """The run as the flat columns every experiment stores: timings (every timer section, every decode step),
        memory by tier and component, OOM, the KV share the policy attended, policy stats."""
        m = self.metrics
        row = {k: m.get(k) for k in ("ttft_s", "setup_s", "prefill_s", "decode_s", "total_s", "decode_tokens",
                                     "decode_tokens_per_s", "decode_tokens_per_s_q1", "decode_tokens_per_s_q3",
                                     "decode_step_s_mean", "decode_step_s_p50", "decode_steps", "completed",
                                     "preemptions", "step_latencies_s")}
        row.update({f"split_{k}_s": v for k, v in m.get("wall_split_s", {}).items()})
        row.update({f"section_{k.replace('.', '_')}_s": v for k, v in (m.get("sections_s") or {}).items()})
        for tier in ("device", "host", "disk"):
            mem = self.memory.get(tier, {})
            row[f"{tier}_peak_bytes"] = mem.get("peak_bytes")
            row.update({f"{tier}_{comp}_peak_bytes": v for comp, v in mem.get("peak_components", {}).items()})
            row[f"{tier}_kv_bytes"] = mem.get("kv_bytes")
        row["oom"] = self.oom is not None
        row["oom_where"] = self.oom["where"] if self.oom else None
        row.update({f"stat_{k}": v for k, v in self.stats.items()
                    if isinstance(v, (int, float, str, bool, list)) or v is None})
        return row


class TokenClock:
    """Client-side timing, as `vllm bench serve` times a server: whoever drives an engine stamps each token when the
    engine hands it over (kvlib's scheduler after each pass, the vLLM backend after each `engine.step()`), so TTFT,
    every inter-token latency and decode throughput come from one rule for every engine, and nothing inside either
    engine times itself. Requests are numbered 0..n-1; times are seconds since the clock started."""

    def __init__(self, requests: int):
        self.start = time.perf_counter()
        self.arrived = [0.0] * requests
        self.stamps: list[list[float]] = [[] for _ in range(requests)]

    def now(self) -> float:
        return time.perf_counter() - self.start

    def arrive(self, request: int, at: float | None = None) -> None:
        """The request arrived now, or at its scheduled time `at` (an open loop: latency counts from when it was
        sent, however long it then waited for the engine)."""
        self.arrived[request] = self.now() if at is None else at

    def handed(self, requests) -> None:
        """One new token of each of these requests was handed over now."""
        at = self.now()
        for r in requests:
            self.stamps[r].append(at)

    def metrics(self) -> dict:
        """build_metrics' timing arguments. The prefill phase ends when every request has its first token; decode
        throughput is the tokens handed over after that, over the time from then to the last one; a decode step is
        the time between two handovers after it."""
        firsts = [s[0] for s in self.stamps if s]
        prefill_end = max(firsts, default=0.0)
        end = max((s[-1] for s in self.stamps if s), default=prefill_end)
        handovers = sorted({t for s in self.stamps for t in s if t > prefill_end})
        return {"ttfts": [s[0] - a for s, a in zip(self.stamps, self.arrived) if s],
                "step_latencies": [b - a for a, b in zip([prefill_end, *handovers], handovers)],
                "prefill_s": prefill_end, "decode_s": end - prefill_end, "total_s": end,
                "decode_tokens": sum(t > prefill_end for s in self.stamps for t in s)}


PERCENTILES = (50, 90, 99)


def latency_metrics(clock: TokenClock, slo_ttft_s: float | None = None, slo_tpot_s: float | None = None) -> dict:
    """A run's latencies and rates as `vllm bench serve` reports a serving run: TTFT, TPOT (a request's time per output
    token after its first), ITL (every gap between a request's tokens) and end-to-end latency, each as mean and
    percentiles; request and output-token throughput over the run (its first arrival to its last token); goodput,
    the requests per second that met the SLO (every limit given), None without one; the most requests handed a
    token in one step (the batch the engine ran at its fullest)."""
    done = [(s, a) for s, a in zip(clock.stamps, clock.arrived) if s]
    ttft = [s[0] - a for s, a in done]
    tpot = [(s[-1] - s[0]) / (len(s) - 1) if len(s) > 1 else 0.0 for s, _ in done]
    series = {"ttft_s": ttft, "tpot_s": [t for t, (s, _) in zip(tpot, done) if len(s) > 1],
              "itl_s": [b - a for s, _ in done for a, b in itertools.pairwise(s)],
              "e2e_s": [s[-1] - a for s, a in done]}
    out = {f"{name}_{stat}": value for name, values in series.items() for stat, value in _summary(values).items()}
    span = max((s[-1] for s, _ in done), default=0.0) - min((a for _, a in done), default=0.0)
    out["request_throughput"] = len(done) / span if span > 0 else None
    out["output_throughput"] = sum(len(s) for s, _ in done) / span if span > 0 else None
    handovers = collections.Counter(t for s, _ in done for t in s)  # one handover: the tokens of one step
    out["max_running"] = max(handovers.values(), default=0)
    out["goodput"] = None
    if (slo_ttft_s is not None or slo_tpot_s is not None) and span > 0:
        met = sum((slo_ttft_s is None or first <= slo_ttft_s) and (slo_tpot_s is None or per <= slo_tpot_s)
                  for first, per in zip(ttft, tpot))
        out["goodput"] = met / span
    return out


def _summary(values: list[float]) -> dict:
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    return {"mean": statistics.fmean(values), **{f"p{q}": float(np.percentile(values, q)) for q in PERCENTILES}}


def wall_split(sections: dict[str, float] | None, prefill_s: float, decode_s: float, total_s: float) -> dict:
    """Total run time as prefill compute + decode compute + cache operations + other (scheduling, sampling).

    From exclusive timer sections keyed `<phase>.<name>` (kvlib.memory.timing). Without sections (an outside backend), only
    prefill and decode wall time are known: cache operations and other are None.
    """
    if sections is None:
        return {"prefill": prefill_s, "decode": decode_s, "cache_ops": None, "other": None}
    split = {"prefill": 0.0, "decode": 0.0, "cache_ops": 0.0}
    for key, seconds in sections.items():
        phase, _, name = key.partition(".")
        if phase == "setup":
            continue  # allocation before the clock starts: reported as setup_s, outside total_s
        split["cache_ops" if name in CACHE_OPS else phase] += seconds
    split["other"] = total_s - sum(split.values())
    return split


def build_metrics(*, ttfts: list[float], step_latencies: list[float], prefill_s: float, decode_s: float,
                  total_s: float, decode_tokens: int, sections: dict[str, float] | None, setup_s: float | None = None,
                  completed: bool = True, **extra) -> dict:
    """The metrics every run reports. prefill_s and decode_s are the wall time of the prefill passes and of the decode
    steps; total_s the whole run after setup (allocation), which TTFT does not include either."""
    return {
        "ttft_s": statistics.fmean(ttfts) if ttfts else None,
        "ttft_per_request_s": ttfts,
        "setup_s": setup_s,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "total_s": total_s,
        "decode_tokens": decode_tokens,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 and decode_tokens else None,
        "decode_step_s_mean": statistics.fmean(step_latencies) if step_latencies else None,
        "decode_step_s_p50": statistics.median(step_latencies) if step_latencies else None,
        **_step_throughput_quartiles(decode_tokens, step_latencies),
        "decode_steps": len(step_latencies),
        "step_latencies_s": step_latencies,
        "wall_split_s": wall_split(sections, prefill_s, decode_s, total_s),
        "sections_s": dict(sections) if sections is not None else None,
        "completed": completed,
        **extra,
    }


def _step_throughput_quartiles(decode_tokens: int, step_latencies: list[float]) -> dict:
    """The spread of decode throughput within a run: the quartiles of each step's tokens per second (a run's decode
    throughput is one number; its steps show how steady the machine was while it was measured)."""
    if len(step_latencies) < 2 or not decode_tokens:
        return {"decode_tokens_per_s_q1": None, "decode_tokens_per_s_q3": None}
    per_step = decode_tokens / len(step_latencies)
    q1, _, q3 = statistics.quantiles([per_step / s for s in step_latencies], n=4)
    return {"decode_tokens_per_s_q1": q1, "decode_tokens_per_s_q3": q3}


def decoded_outputs(tokenizer, generated: list[list[int]], prompts: list[list[int]]) -> list[dict]:
    return [{"token_ids": g, "text": tokenizer.decode(g, skip_special_tokens=True), "prompt_tokens": len(p)}
            for g, p in zip(generated, prompts)]


def oom_record(exc: Exception, phase: str) -> dict:
    if isinstance(exc, DeviceOOM):
        return {"phase": phase, "where": exc.where, "requested_bytes": exc.requested,
                "in_use_bytes": exc.in_use, "capacity_bytes": exc.capacity, "kind": "capacity"}
    return {"phase": phase, "where": str(exc).splitlines()[0], "kind": "cuda"}
