"""What the engine-based experiments share: a point's model and engine, and one run of its runner on given prompts,
measured by the timing protocol, from what the executor's process keeps (kvlib.study.kept)."""

from __future__ import annotations

from collections.abc import Callable

from kvlib.engine import Engine
from kvlib.engine.run_result import RunResult
from kvlib.models import LoadedModel
from kvlib.models.random_weights import CAVEAT
from kvlib.models.workloads import calibration_prompt
from kvlib.policies import make_policy
from kvlib.study.experiment import check_weights
from kvlib.study.kept import Kept
from kvlib.study.point import Point
from kvlib.study.runners import make_runner


def model_of(point: Point, kept: Kept) -> LoadedModel:
    check_weights(point.experiment, point.weights)
    return kept.model(point.model, point.device, point.weights)


def make_engine(point: Point, kept: Kept, instrumented: bool = True) -> Engine:
    """The engine for a kvlib policy's point. A policy that calibrates (InfiniGen) does so on the profile's text
    (`calibration_source` among an experiment's fixed values; the CPython docs by default)."""
    loaded = model_of(point, kept)
    return Engine(loaded, make_policy(point.runner, **point.settings), device_capacity_bytes=point.capacity_bytes,
                  calibration=calibration_prompt(loaded, point.values.get("calibration_source")),
                  instrumented=instrumented)


def run(point: Point, kept: Kept, prompts: list[list[int]], max_new_tokens: int, *, memory_run: bool) -> RunResult:
    """One generation run of the point's runner on the given prompts (ignoring EOS, so lengths are as asked), with
    the point's prefill mode, or the runner's preferred one. An outside engine (the real vLLM) runs the same prompts
    its own way. memory_run (always said: without it a kvlib engine checks no device capacity): the engine reads
    what it holds as it goes, kvlib's ledger and timer sections or vLLM's KV blocks (a run that is not timed);
    otherwise neither engine reads anything from inside itself."""
    runner = make_runner(point.runner, **point.settings)
    if runner.outside:
        return runner.generate(point.model, prompts, max_new_tokens, stop_at_eos=False,
                               device_capacity_bytes=point.capacity_bytes, weights=point.weights,
                               read_memory=memory_run)
    mode = point.values.get("prefill", runner.preferred_prefill)
    return make_engine(point, kept, instrumented=memory_run).generate(prompts, max_new_tokens, prefill_mode=mode,
                                       chunk_size=point.values.get("chunk_size", 512), stop_at_eos=False)


def accounting_columns(row: dict) -> dict:
    """What a run held (memory by tier and component, the blocks it used, whether it ran out) and where the engine's
    own sections put its time: what only an engine that reads itself can say."""
    return {k: v for k, v in row.items() if k.startswith(("device_", "host_", "disk_", "section_", "split_"))
            or k in ("oom", "oom_where", "stat_peak_blocks_used", "setup_s")}


def warm_then_timed(point: Point, kept: Kept, measure: Callable[[bool], dict]) -> tuple[dict, dict | None]:
    """The protocol every timed experiment measures by (book/methods.md, "How runs are timed"): the first time a
    process meets the point, an untimed run (`measure(True)`: the first call of each matmul shape, vLLM's kernels, a
    policy's calibration: every runner warm on the shapes it is measured on), which is also the run that reads memory
    and kvlib's timer sections (vLLM's KV use step by step); then the timed run (`measure(False)`), in which nothing
    is read from inside either engine (kvlib's ledger and sections off, vLLM's statistics at its default): its TTFT,
    inter-token latencies and throughputs are stamped by the caller as each token is handed over
    (kvlib.engine.run_result.TokenClock). A later repeat of the point in the same process is timed at once: the
    process is warm on its shapes, and the point's key fixes its inputs (the untimed rows are the process's: `kept`).
    Returns (the untimed run's row, the timed run's row); the timed one is None where the untimed run ran out of
    memory (the same inputs would run out again, unbooked)."""
    if point.key not in kept.untimed:
        kept.untimed[point.key] = measure(True)
    warm = kept.untimed[point.key]
    return warm, None if warm["oom"] else measure(False)


def run_timed(point: Point, kept: Kept, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """The point's generation run as its result row, measured alike for every runner (warm_then_timed): the timed
    run's figures, with the untimed run's memory and wall-split columns."""
    warm, timed = warm_then_timed(point, kept, lambda memory_run: result_row(
        run(point, kept, prompts, max_new_tokens, memory_run=memory_run), point))
    if timed is None:
        return dict(warm)  # a copy: callers add columns to their row, and this one is kept for the point's repeats
    return {**timed, **accounting_columns(warm)}


def result_row(result: RunResult, point: Point) -> dict:
    """A run's result row (RunResult.row), with the caveat random weights carry."""
    return {**({"caveat": CAVEAT} if point.weights == "random" else {}), **result.row()}
