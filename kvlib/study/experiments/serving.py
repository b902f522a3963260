"""Serving under a request rate (issue 33): an open-loop trace of requests, replayed by every runner under continuous
batching with chunked prefill, measured as `vllm bench serve` measures a server. Each runner serves under the schedule
its class declares (`serving_schedule`, kvlib.engine.scheduler): `continuous`, where a full block pool preempts a
request as vLLM does, for all but `compress_h2o` (issue 45), which compresses a running request's cache instead; its
row says how often and whom (`compressions`, `compressed_requests`, `stat_compressions` with when and by how much),
and every kvlib row carries each request's output token ids, so that the report can tell what compression cost the
requests it touched against `paged`'s tokens on the same trace.

A point is a runner at a request rate; the profile fixes the rest (`serving` section of params/<profile>.yaml):

    num_requests: 24                                   # requests in the trace
    min_prompt_tokens: 128, max_prompt_tokens: 512     # prompt lengths, uniform between them (seeded)
    min_output_tokens: 16, max_output_tokens: 64       # output lengths, uniform between them (seeded), EOS ignored
    burstiness: 1.0                                    # gamma shape of the gaps: 1 a Poisson process, below 1 burstier
    seed: 0
    chunk_size: 256                                    # kvlib's chunked prefill (vLLM schedules its own chunks)
    slo_ttft_s: 2.0, slo_tpot_s: 0.25                  # goodput counts the requests within both

The rate is `request_rate` (requests/s), or `rate_multiple`: a multiple of this machine's service rate, so that the
grid asks the same of a fast machine as of a slow one (`vllm bench sweep` finds its rates the same way, from the
server). The service rate is `paged`'s (kvlib's vLLM-like baseline, at its defaults and the point's capacity) with
the whole trace arriving at once: the requests it completes per second when it never waits for one. It is measured
once per trace, model, capacity and machine, before the first point that needs it, and kept in kvlib's cache
(`service_rates.json`: every runner of a grid runs at the same rates); each row carries the rate it ran at
(`request_rate`), its multiple and the service rate it came from.

The trace (`trace_of`) is a function of those values and the rate alone: the same prompts (cut from the offline text
at seeded offsets), output lengths and arrival times for every runner at a rate, the real vLLM included (its backend
adds each request once the clock passes its arrival, as kvlib's scheduler admits it). The prompts and output lengths
do not depend on the rate, and the arrival gaps at one seed are the same draws scaled by 1 / rate: between rates only
the clock changes. Each row carries the trace's digest (`trace_sha`), so a reader can check that every runner at a
rate replayed the same trace.

Timed by the book's rule (book/methods.md, "How runs are timed"; kvlib.study.experiments.common.run_timed): the first
time a process meets a point, an instrumented replay of the whole trace (every runner warm on its shapes; the only
run that reads memory: kvlib's ledger and pool, vLLM's KV blocks and preemptions step by step), then a bare replay
whose latencies are the row's. A runner whose setup does not fit the device capacity is an OOM row.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, replace

from kvlib.engine.arrivals import arrival_times
from kvlib.engine.run_result import PERCENTILES, RunResult
from kvlib.errors import RequestTooLarge, UserError
from kvlib.models.workloads import prompt_of_length
from kvlib.report.pages import TIMING
from kvlib.report.serving import page as chapter
from kvlib.study.checks import optional, positive_int, positive_number
from kvlib.study.experiment import Experiment, register
from kvlib.study.experiments.common import accounting_columns, make_engine, model_of, result_row, warm_then_timed
from kvlib.study.kept import Kept
from kvlib.study.point import Point
from kvlib.study.runners import make_runner

# the latency metrics of a serving run (kvlib.engine.run_result.latency_metrics), each a column of the row
LATENCY_COLUMNS = tuple(f"{name}_{stat}" for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s")
                        for stat in ("mean", *(f"p{q}" for q in PERCENTILES))) + (
    "request_throughput", "output_throughput", "goodput", "max_running")


@dataclass(frozen=True)
class Trace:
    """What a serving run replays: each request's prompt, output length and arrival (seconds from the first)."""

    prompts: tuple[tuple[int, ...], ...]
    output_tokens: tuple[int, ...]
    arrivals_s: tuple[float, ...]

    @property
    def sha(self) -> str:
        text = json.dumps([self.prompts, self.output_tokens, [round(a, 9) for a in self.arrivals_s]])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def longest(self) -> int:
        """The most tokens one request holds: its prompt and every output token."""
        return max(len(p) + n for p, n in zip(self.prompts, self.output_tokens))

    def columns(self) -> dict:
        return {"trace_sha": self.sha, "prompt_tokens_total": sum(map(len, self.prompts)),
                "output_tokens_total": sum(self.output_tokens), "trace_span_s": self.arrivals_s[-1]}


def trace_of(tokenizer, values: dict) -> Trace:
    """The point's trace, from its workload values (see the module's docstring) and nothing else."""
    n, seed = values["num_requests"], values.get("seed", 0)
    for low, high in (("min_prompt_tokens", "max_prompt_tokens"), ("min_output_tokens", "max_output_tokens")):
        if not 1 <= values[low] <= values[high]:
            raise UserError(f"serving: need 1 <= {low} <= {high}, got {values[low]} and {values[high]}")
    rng = random.Random(seed)  # lengths and text offsets: the same for every rate
    prompt_lengths = [rng.randint(values["min_prompt_tokens"], values["max_prompt_tokens"]) for _ in range(n)]
    output_lengths = [rng.randint(values["min_output_tokens"], values["max_output_tokens"]) for _ in range(n)]
    offsets = [rng.randrange(10**9) for _ in range(n)]
    prompts = tuple(tuple(prompt_of_length(tokenizer, length, offset=offset, source=values.get("text_source")))
                    for length, offset in zip(prompt_lengths, offsets))
    arrivals = arrival_times(n, float(values["request_rate"]), values.get("burstiness", 1.0), seed)
    return Trace(prompts, tuple(output_lengths), tuple(arrivals))


def slo_of(values: dict) -> dict:
    return {k: values[f"slo_{k}"] for k in ("ttft_s", "tpot_s") if values.get(f"slo_{k}") is not None}


def serve(point: Point, kept: Kept, trace: Trace, *, memory_run: bool) -> RunResult:
    """One replay of the trace by the point's runner. memory_run: the engine reads what it holds as it goes (kvlib's
    ledger and timer sections, vLLM's KV blocks and preemptions); otherwise nothing is read from inside it."""
    from kvlib.engine.scheduler import RunSettings, Sequence

    runner = make_runner(point.runner, **point.settings)
    prompts = [list(p) for p in trace.prompts]
    if runner.outside:
        return runner.generate(point.model, prompts, list(trace.output_tokens), stop_at_eos=False,
                               device_capacity_bytes=point.capacity_bytes, weights=point.weights,
                               read_memory=memory_run, arrivals=list(trace.arrivals_s), slo=slo_of(point.values),
                               max_model_len=trace.longest)
    requests = [Sequence(p, n, arrival_s=a) for p, n, a in zip(prompts, trace.output_tokens, trace.arrivals_s)]
    settings = RunSettings(runner.serving_schedule, "chunked", point.values.get("chunk_size", 512),
                           stop_at_eos=False, slo=slo_of(point.values))
    return make_engine(point, kept, instrumented=memory_run).run(requests, settings)


def serving_row(result: RunResult, point: Point) -> dict:
    """The run's row (RunResult.row) with every serving metric as a column of its own, what compression did
    (compression_columns), and each request's output token ids in trace order (`output_token_ids`, a list a request:
    kvlib.report.serving compares them across runners on the same trace)."""
    return {**result_row(result, point), **{k: result.metrics.get(k) for k in LATENCY_COLUMNS},
            **compression_columns(result.stats.get("compressions")),
            "output_token_ids": [list(o["token_ids"]) for o in result.outputs] if result.outputs else None}


def compression_columns(compressions: list[dict] | None) -> dict:
    """Under the compress schedule (kvlib.engine.scheduler): how many compressions, of how many requests, which
    (their trace indices, sorted), and the mean share of its entries a compression kept (after / before); None for a
    runner that never compresses (it preempts)."""
    if compressions is None:
        return {"compressions": None, "requests_compressed": None, "compressed_requests": None,
                "entries_kept_share": None}
    shares = [c["entries_after"] / c["entries_before"] for c in compressions]
    requests = sorted({c["request"] for c in compressions})
    return {"compressions": len(compressions), "requests_compressed": len(requests), "compressed_requests": requests,
            "entries_kept_share": sum(shares) / len(shares) if shares else None}


def _does_not_fit(point: Point, trace: Trace) -> dict | None:
    """An OOM row for vLLM where it would refuse to start at the point's capacity (VLLMBackend.refusal: no KV pool
    left, or none that holds the trace's longest request). kvlib's own pools are asked as they serve: the scheduler
    raises RequestTooLarge where one request does not fit even alone."""
    runner = make_runner(point.runner, **point.settings)
    why = runner.refusal(point.model, point.capacity_bytes, trace.longest) if runner.outside else None
    return None if why is None else _oom_row(why)


def _oom_row(where: str) -> dict:
    """The row of a point whose runner cannot hold one request of the trace at the capacity: nothing measured."""
    return {"oom": True, "oom_where": where, "completed": False, **{k: None for k in LATENCY_COLUMNS},
            "preemptions": None, "slo_attainment": None}


SERVICE_RATE_FILE = "service_rates.json"


def service_rate(point: Point, kept: Kept) -> float:
    """This machine's service rate for the point's trace (the module's docstring): measured once, then read."""
    from kvlib.paths import cache_dir
    from kvlib.study.machine import machine

    trace_values = {k: v for k, v in point.values.items() if k not in ("request_rate", "rate_multiple")}
    cpu = machine()["machine_cpu"]
    key = hashlib.sha256(json.dumps([trace_values, point.model, point.weights, point.device,
                                     point.device_capacity_gb, cpu], sort_keys=True,
                                    default=str).encode()).hexdigest()[:16]
    path = cache_dir() / SERVICE_RATE_FILE
    known = json.loads(path.read_text()) if path.exists() else {}
    if key not in known:
        probe = replace(point, runner="paged", settings={}, values={**trace_values, "request_rate": 1e9})
        row = _replay(probe, kept, trace_of(model_of(point, kept).tokenizer, probe.values), memory_run=False)
        if not row.get("request_throughput"):
            raise UserError(f"serving: paged could not serve the trace at the point's capacity to measure this "
                            f"machine's service rate ({row.get('oom_where')})")
        known[key] = {"requests_per_s": row["request_throughput"], "machine_cpu": cpu}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(known, indent=1))
    return known[key]["requests_per_s"]


def resolved(point: Point, kept: Kept) -> tuple[Point, dict]:
    """The point with its request rate in requests/s (a `rate_multiple` times the service rate), and the columns
    saying where the rate came from."""
    if "rate_multiple" not in point.values:
        return point, {}
    rate = service_rate(point, kept)
    multiple = point.values["rate_multiple"]
    return (replace(point, values={**point.values, "request_rate": multiple * rate}),
            {"request_rate": multiple * rate, "service_rate": rate})


def run_point(point: Point, kept: Kept) -> list[dict]:
    point, rate_columns = resolved(point, kept)
    trace = trace_of(model_of(point, kept).tokenizer, point.values)
    row = _does_not_fit(point, trace)
    if row is None:
        warm, timed = warm_then_timed(point, kept,
                                      lambda memory_run: _replay(point, kept, trace, memory_run=memory_run))
        if timed is None:
            row = dict(warm)
        else:
            # preemptions: counted by kvlib's scheduler in either replay; vLLM's are read from its scheduler, only in
            # the instrumented one
            preemptions = timed["preemptions"] if timed.get("preemptions") is not None else warm["preemptions"]
            row = {**timed, **accounting_columns(warm), "preemptions": preemptions,
                   "stat_peak_blocks_used": warm.get("stat_peak_blocks_used"),
                   "untimed_max_running": warm["max_running"]}
    return [{**row, **trace.columns(), **rate_columns, "slo_ttft_s": point.values.get("slo_ttft_s"),
             "slo_tpot_s": point.values.get("slo_tpot_s")}]


def _replay(point: Point, kept: Kept, trace: Trace, *, memory_run: bool) -> dict:
    try:
        result = serve(point, kept, trace, memory_run=memory_run)
    except RequestTooLarge as exc:  # the capacity does not fit this runner: one request does not fit even alone
        return _oom_row(str(exc))
    row = serving_row(result, point)
    good, served = row.get("goodput"), row.get("request_throughput")
    # the share of requests within every SLO limit (goodput and request throughput share one time span; rounded, so
    # that 9 of 10 reads 0.9 and not 0.8999...)
    row["slo_attainment"] = round(good / served, 9) if good is not None and served else None
    if row.get("preemptions") is None:
        row["preemptions"] = result.stats.get("preemptions")
    return row


EXPERIMENT = register(Experiment(
    "serving", "Serving under a request rate", run_point, timed=True, trained_only=True,
    workload={"num_requests": positive_int, "min_prompt_tokens": positive_int, "max_prompt_tokens": positive_int,
              "min_output_tokens": positive_int, "max_output_tokens": positive_int,
              "request_rate": positive_number, "rate_multiple": positive_number, "burstiness": positive_number,
              "slo_ttft_s": optional(positive_number), "slo_tpot_s": optional(positive_number)},
    required=("num_requests", "min_prompt_tokens", "max_prompt_tokens", "min_output_tokens", "max_output_tokens",
              ("request_rate", "rate_multiple")),
    lead=chapter.lead, error_rate=TIMING.statement()))
