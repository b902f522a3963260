"""What the engine-based experiments share: a model cache, and one run of a point's runner on given prompts."""

from __future__ import annotations

import functools
import time

from kvlib.engine import Engine
from kvlib.engine.run_result import RunResult
from kvlib.models import LoadedModel, load_model
from kvlib.models.random_weights import CAVEAT, check_experiment
from kvlib.models.workloads import calibration_prompt
from kvlib.policies import make_policy
from kvlib.study.profile import Point
from kvlib.study.runners import make_runner


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
    """A run's result row (RunResult.row), with the caveat random weights carry."""
    return {**({"caveat": CAVEAT} if point.weights == "random" else {}), **result.row()}


# each wall is the fastest of this many timings, alternating 1 and N: a stall of the host only ever adds time (one
# pair of walls gave paged -7,366 tok/s in benchmarks/bench_decode.py: its 1-token run outlasted its 33-token run)
OUTSIDE_TIMINGS = 2
OUTSIDE_COLUMNS = ("decode_tokens_per_s", "decode_tokens_per_s_q1", "decode_tokens_per_s_q3")


def run_measured_from_outside(point: Point, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """The point's run as its result row, with decode throughput measured from outside the engine, as
    benchmarks/bench_decode.py measures every engine (book/methods.md, "How decode throughput is measured"): after an
    untimed warm-up on the same prompts (vLLM's engine start, a policy's calibration, the first call of each matmul
    shape), the same run with 1 new token and with N, each timed around the whole call, OUTSIDE_TIMINGS times
    alternating: decode_tokens_per_s = (N - 1) x rows / (min wall(N) - min wall(1)). Prefill, allocation and setup are
    in both walls and cancel; nothing inside an engine is trusted to time itself, so kvlib's policies and vLLM are
    measured alike. The engine's own figures (its decode sections, per-step quartiles) stay as
    engine_decode_tokens_per_s[_q1|_q3]; the memory, TTFT and every other column are the last N-token run's."""
    run(point, prompts, 2)
    walls, results = {1: [], max_new_tokens: []}, {}
    for _ in range(OUTSIDE_TIMINGS):
        for n, timings in walls.items():
            begin = time.perf_counter()
            results[n] = run(point, prompts, n)
            timings.append(time.perf_counter() - begin)
    walls = {n: min(w) for n, w in walls.items()}
    row = result_row(results[max_new_tokens], point)
    for column in OUTSIDE_COLUMNS:
        row[f"engine_{column}"] = row.pop(column, None)
    measured = max_new_tokens > 1 and not any(r.oom for r in results.values()) and walls[max_new_tokens] > walls[1]
    row["decode_tokens_per_s"] = ((max_new_tokens - 1) * len(prompts) / (walls[max_new_tokens] - walls[1])
                                  if measured else None)
    row["decode_tokens_per_s_q1"] = row["decode_tokens_per_s_q3"] = None  # one figure a run: spread over repeats
    row["wall_1_token_s"], row["wall_s"] = walls[1], walls[max_new_tokens]
    return row
