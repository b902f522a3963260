"""Computing a profile's grid: one function computes a unit of work (a point's repeat) into its result rows; an
executor runs the units that are not stored yet and hands each finished unit back to be written.

An exception in a unit never stops the others, in any executor: it is reported as it happens, nothing of that unit
is written, and once every other unit is stored the run fails with `UnitsFailed`, naming each failed unit with its
error, so a rerun computes exactly those.

Repeats run interleaved, in rounds: every point once, then every point again, so a slow minute of the machine does
not land on one policy's repeats. In a timed experiment each round runs its points in a seeded random order (`rounds`),
recorded in the rows (`round_slot`), so that a drift within a round (the machine warming, memory filling) falls on
every runner alike and the repeats of two runners are exchangeable, as the timing rule's permutation test assumes
(kvlib.report.stats; tests/report/test_stats.py simulates such a drift under a fixed and a random order). Each unit
records the machine's load while it ran (kvlib.study.machine_load); one measured while other processes took the CPU is
measured once more if the experiment is timed (`timed` in its declaration, kvlib.study.experiment), and flagged
`disturbed` if it still was.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import platform
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from datetime import UTC, datetime
from typing import Protocol

import numpy as np
import pandas as pd
from tqdm import tqdm

import kvlib
from kvlib.errors import UserError
from kvlib.paths import machine_limits
from kvlib.study import results
from kvlib.study.experiments import experiment as declared
from kvlib.study.kept import Kept
from kvlib.study.limits import record
from kvlib.study.machine import machine
from kvlib.study.machine_load import measured_load
from kvlib.study.point import Point
from kvlib.study.profile import Profile
from kvlib.study.runners import runner_class, runners

ATTEMPTS = 2  # a timed unit measured while other processes took the CPU is measured once more

Unit = tuple[Point, int]  # a point and the index of its repeat


def compute_unit(point: Point, repeat: int, meta: dict) -> pd.DataFrame:
    """The result rows of one repeat of one point: the point's columns, what the experiment measured, the run's
    metadata, the machine that computed it (kvlib.study.machine: read in the process that measures, a Ray worker's
    or a fresh one's) and that machine's load while it ran.

    A point of an outside engine (the real vLLM) is computed in a process of its own, which computes nothing else
    (`in_outside_process`). Starting vLLM changes the process it runs in: two more OpenMP runtimes,
    `torch.set_num_threads` made a no-op, NUMA binding (book/methods.md, "Why engines are not compared in one
    process"); every kvlib point computed after it in the same process would be measured in that process."""
    if runner_class(point.runner).outside:
        return in_outside_process(_compute_unit, point, repeat, meta)
    return _compute_unit(point, repeat, meta)


_outside_pool: ProcessPoolExecutor | None = None
_kept = Kept()  # what this process keeps from one point to the next, handed to each (kvlib.study.kept)
# in a worker of Processes: the study's process, whose other workers share the cores on purpose (not a disturbance)
_study_process: int | None = None


def in_outside_process(fn, *args):
    """fn(*args) in the process the outside engines run in: spawned (not forked: nothing of this process's threads
    or libraries comes along) at the first call and kept, as kvlib's engine keeps this one, so that vLLM starts once
    for a study rather than once per unit, and is as warm as kvlib's engine is when timed. Its exception, if any, is
    raised here; a process that died is replaced at the next call."""
    global _outside_pool
    if _outside_pool is None:
        _outside_pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_end_with_study, initargs=(os.getpid(),))
    try:
        return _outside_pool.submit(fn, *args).result()
    except BrokenProcessPool:
        _outside_pool = None
        raise


def _compute_unit(point: Point, repeat: int, meta: dict) -> pd.DataFrame:
    experiment = declared(point.experiment)
    # a disturbed run is worth measuring again only where time is what it measures: a score is the same under load
    compute_s = 0.0  # what the unit cost the build, every attempt (benchmarks/book_times.py adds them up)
    for attempt in range(1, (ATTEMPTS if experiment.timed else 1) + 1):
        with measured_load(_study_process) as load:
            rows = experiment.run_point(point, _kept)
        compute_s += load.wall_s
        if not load.disturbed:
            break
    finished = datetime.now(UTC).isoformat()
    return pd.DataFrame([{**point.columns(), **row, **meta, **machine(), "repeat": repeat, "attempts": attempt,
                          "unit_compute_s": compute_s, **load.columns(), "finished_at": finished} for row in rows])


class UnitsFailed(UserError):
    """Units whose computation raised (or whose Ray worker died more often than retried): `failures` holds
    (point, repeat, message) for each."""

    def __init__(self, failures: list, total: int):
        self.failures, self.total = failures, total
        lines = [f"  {p.experiment} {p.runner} {p.key} r{r}: {message.strip().splitlines()[-1]}"
                 for p, r, message in failures]
        super().__init__(f"{len(failures)} of {total} unit(s) failed; every other unit is stored and a rerun "
                         f"computes only these:\n" + "\n".join(lines))


def error_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


def report_failure(point: Point, repeat: int, error: str) -> None:
    tqdm.write(f"kvlib: {point.experiment} {point.runner} {point.key} r{repeat} failed:\n{error}", file=sys.stderr)


class Executor(Protocol):
    def run(self, units: list[Unit], meta: dict, done: Callable[[Point, int, pd.DataFrame], None]) -> None:
        """Compute every unit and call done(point, repeat, rows) as each finishes (in any order); raise UnitsFailed
        at the end if any unit raised."""


class Serial:
    """Every unit in this process, one after the other (the default)."""

    def run(self, units, meta, done):
        failures = []
        for point, repeat in units:
            settle(point, repeat, lambda p=point, r=repeat: compute_unit(p, r, meta), done, failures)
        if failures:
            raise UnitsFailed(failures, len(units))


def settle(point: Point, repeat: int, rows: Callable[[], pd.DataFrame], done, failures: list) -> None:
    """A unit's outcome: its rows handed to done, or its exception reported and kept in failures (the others go
    on)."""
    try:
        computed = rows()
    except Exception as exc:  # noqa: BLE001 -- any exception of a unit is that unit's recorded error
        failures.append((point, repeat, error_text(exc)))
        report_failure(*failures[-1])
        return
    done(point, repeat, computed)


class Processes:
    """Units in `workers` spawned processes of `threads` torch threads each, kept for the experiment (a worker loads a
    model once, as this process does): an untimed experiment's passes at batch 1 leave a 2-core machine's second
    core half idle in one process, and two one-thread workers compute more units an hour than one two-thread
    process (benchmarks/README.md). Never a timed experiment: its units would share the cores they are timed on.
    A unit's rows are the same bits at one thread as at two (tests/study/test_executor_processes.py).

    affinity: units with the same key go to the same worker, in their order (an accuracy task's points share the
    prefills its worker recorded, as they do in one process). weight: a unit's expected time (the reference book's,
    kvlib.study.estimate.unit_weight; else every unit alike): the keys are dealt out heaviest first, each to the
    worker with the least time so far."""

    # what a worker runs, and what runs again here a unit a dead worker lost (tests put theirs)
    in_worker: Callable[[Point, int, dict], pd.DataFrame]
    here: Callable[[Point, int, dict], pd.DataFrame]

    def __init__(self, workers: int, threads: int = 1, affinity: Callable[[Point], object] | None = None,
                 weight: Callable[[Point, int], float] | None = None):
        self.workers, self.threads, self.affinity, self.weight = workers, threads, affinity, weight
        self.in_worker, self.here = _worker_unit, compute_unit

    def lanes(self, units: list[Unit]) -> list[list[Unit]]:
        groups: dict[object, list[Unit]] = {}
        for i, (point, repeat) in enumerate(units):
            groups.setdefault(self.affinity(point) if self.affinity else i, []).append((point, repeat))

        def load(group: list[Unit]) -> float:
            return sum(self.weight(p, r) for p, r in group) if self.weight else len(group)

        lanes: list[list[Unit]] = [[] for _ in range(self.workers)]
        for group in sorted(groups.values(), key=load, reverse=True):
            min(lanes, key=load).extend(group)
        return [lane for lane in lanes if lane]

    def run(self, units, meta, done):
        from concurrent.futures import as_completed

        beside = {**meta, "unit_workers": self.workers}  # a unit's time is shared with the others'
        _kept.release()  # this process waits while its workers compute: what it holds would sit beside theirs
        failures, futures, pools, lost = [], {}, [], []
        try:
            for lane in self.lanes(units):
                pools.append(ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_start_worker, initargs=(self.threads, os.getpid())))
                futures |= {pools[-1].submit(self.in_worker, point, repeat, beside): (point, repeat)
                            for point, repeat in lane}
            for future in as_completed(futures):
                if isinstance(future.exception(), BrokenProcessPool):
                    lost.append(futures[future])
                    continue
                settle(*futures[future], future.result, done, failures)
        finally:
            for pool in pools:
                pool.shutdown(cancel_futures=True)
        if lost:
            # a worker killed from outside (the kernel's out-of-memory killer, most often: each worker holds its own
            # model) took its lane down: once the others are done, its units run here, one at a time
            print(f"kvlib: a worker process died (out of memory?); its {len(lost)} unit(s) run again in this process, "
                  "one at a time", file=sys.stderr)
            for point, repeat in lost:
                settle(point, repeat, lambda p=point, r=repeat: self.here(p, r, meta), done, failures)
        if failures:
            raise UnitsFailed(failures, len(units))


def _start_worker(threads: int, study_process: int) -> None:
    global _study_process
    import torch

    torch.set_num_threads(threads)
    _study_process = study_process
    _end_with_study(study_process)


def _end_with_study(study_process: int) -> None:
    """A spawned process (a worker, the outside engines') ends with its study: a study killed alone (not its process
    group, as Ctrl-C does) left them computing for nobody, each holding its model's memory (vLLM's: 3.8 GB)."""
    threading.Thread(target=_exit_with, args=(study_process,), daemon=True).start()


def _exit_with(study_process: int) -> None:
    while os.getppid() == study_process:
        time.sleep(2)
    os._exit(1)


def _worker_unit(point: Point, repeat: int, meta: dict) -> pd.DataFrame:
    return compute_unit(point, repeat, {**meta, **machine_metadata()})  # the worker's own threads in its rows


WORKER_GIB = 8.0  # an accuracy worker of the embedded book: a small model and its recorded prefills
# a worker's memory over its model's fp32 weights, with room for its peaks: a Qwen2.5-Coder-1.5B worker (weights
# 6.2 GB) held 10.9-11.3 GB, and two of them beside anything else were killed for memory on a 24 GB machine
WEIGHT_COPIES = 2.2


def worker_gib(points: Iterable[Point], held: Callable[[Point], float] | None = None) -> float:
    """The memory one worker needs for these points: WORKER_GIB, or more where a point's model is an embedded one
    whose fp32 weights, WEIGHT_COPIES times over, and what the worker holds beside them for the point (`held`, the
    experiment's `held_gib`) are larger."""
    from kvlib.models.embedded import EMBEDDED_MODELS

    sizes = [(EMBEDDED_MODELS[p.model].parameters * 4 * WEIGHT_COPIES / 2**30 if p.model in EMBEDDED_MODELS else 0)
             + (held(p) if held else 0) for p in points]
    return max([WORKER_GIB, *sizes])


def untimed_workers(memory_per_worker_gib: float = WORKER_GIB) -> int:
    """How many one-thread workers an untimed experiment gets here: a core each, as many as the memory holds."""
    pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return max(1, min(os.cpu_count() or 1, int(pages * size / 2**30 // memory_per_worker_gib)))


def machine_metadata() -> dict:
    """What the machine that computes a unit brings to its rows (a Ray worker reports its own)."""
    import torch
    import transformers

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"torch_version": torch.__version__, "transformers_version": transformers.__version__,
            "device_name": device, "cpu_threads": torch.get_num_threads()}


def run_metadata(profile: str) -> dict:
    sha = results.commit()
    machine = machine_metadata()
    return {"profile": profile, "kvlib_version": kvlib.__version__, "torch_version": machine["torch_version"],
            "transformers_version": machine["transformers_version"], "git_sha": sha,
            "device_name": machine["device_name"], "cpu_threads": machine["cpu_threads"]}


def rounds(points: list[Point], repeats: int, seed: str, shuffled: bool = True) -> list[tuple[Point, int, int]]:
    """(point, repeat, slot) for every repeat of every point, round by round; within round r the points in an order
    drawn from `seed` and r (stable across runs, so a resumed run computes the same order), or as listed where not
    shuffled. slot: the unit's place in its round."""
    out = []
    for r in range(repeats):
        if shuffled:
            digest = hashlib.sha256(f"{seed}/{r}".encode()).digest()
            order = np.random.default_rng(int.from_bytes(digest[:8], "little")).permutation(len(points))
        else:
            order = range(len(points))
        out += [(points[i], r, slot) for slot, i in enumerate(order)]
    return out


def selected_points(points: list[Point], policies: Iterable[str] | None = None) -> list[Point]:
    if policies is not None:
        unknown = sorted(set(policies) - set(runners()))
        if unknown:
            raise UserError(f"unknown policies {unknown}: choose from {runners()}")
        points = [p for p in points if p.runner in policies]
    return points


def stored(profile: str, experiment: str, point: Point, repeat: int) -> bool:
    return results.unit_path(profile, experiment, point.key, repeat).exists()


def units_to_compute(profile: Profile, experiment: str, force: bool = False,
                     policies: Iterable[str] | None = None) -> list[tuple[Point, int]]:
    """(point, repeat) of every unit run_experiment would compute."""
    points = selected_points(profile.points(experiment), policies)
    return [(p, r) for r in range(profile.repeats(experiment)) for p in points
            if force or not stored(profile.name, experiment, p, r)]


def run_experiment(profile: Profile, experiment: str, force: bool = False, progress: bool = True,
                   policies: Iterable[str] | None = None, executor: Executor | None = None, workers: int = 1) -> None:
    """Store every missing unit of one experiment (of the given policies only, if any), and the manifest of the
    profile's grid. workers: processes an untimed experiment's units share (Processes) where no executor is given;
    a timed experiment's units run one at a time whatever it says."""
    if experiment not in profile.experiments:
        raise UserError(f"profile {profile.name!r} has no experiment {experiment!r}; "
                        f"it has {sorted(profile.experiments)}")
    grid = profile.points(experiment)
    points = selected_points(grid, policies)
    repeats = profile.repeats(experiment)
    results.write_manifest(profile.name, experiment, [p.key for p in grid], repeats)
    declaration = declared(experiment)
    timed = declaration.timed
    if not timed and declaration.order:  # an untimed experiment may run its points in the order it reads best
        points = sorted(points, key=declaration.order)
    ordered = rounds(points, repeats, f"{profile.name}/{experiment}", shuffled=timed)
    slots = {(p.key, r): slot for p, r, slot in ordered}
    units = [(p, r) for p, r, _ in ordered]
    todo = [(p, r) for p, r in units if force or not stored(profile.name, experiment, p, r)]
    if timed and todo and executor is None:
        # this machine's limits beside the rows it is about to time: their bounds are read against them
        record(machine_limits(profile.name), machine())
    bar = tqdm(total=len(units), initial=len(units) - len(todo), desc=f"{profile.name}/{experiment}", unit="run",
               disable=not progress)

    def done(point: Point, repeat: int, rows: pd.DataFrame) -> None:
        results.write_unit(profile.name, experiment, point.key, repeat,
                           rows.assign(round_slot=slots[(point.key, repeat)]))
        bar.update(1)

    parts = [(executor or Serial(), todo)]
    if executor is None and not timed:
        from kvlib.study.estimate import unit_weight

        split = memory_parts(todo, workers, declaration.held_gib)
        weight = unit_weight(profile.name, experiment) if any(n > 1 for n, _ in split) else None
        parts = [(Processes(n, affinity=declaration.order, weight=weight) if n > 1 else Serial(), part)
                 for n, part in split]
    meta = run_metadata(profile.name)
    try:
        for run, part in parts:
            run.run(part, meta, done)
    finally:
        bar.close()


def memory_parts(todo: list[Unit], workers: int, held: Callable[[Point], float] | None = None
                 ) -> list[tuple[int, list[Unit]]]:
    """An untimed experiment's units split by how many workers the memory holds for each (worker_gib: its model and
    what it holds beside), each part with its workers (at most `workers`, at most a unit each), in the order the
    units come: a profile whose largest model runs alone still computes its small models' units two at a time."""
    parts: dict[int, list[Unit]] = {}
    for unit in todo:
        parts.setdefault(min(workers, untimed_workers(worker_gib([unit[0]], held))), []).append(unit)
    return [(min(n, len(part)), part) for n, part in parts.items()]
