"""The grid on many machines: an executor that computes units on a Ray cluster (`kvlib study --executor ray`).

One actor per worker process, each computing one unit at a time with the same `compute_unit` the serial executor
calls, so a model's weights load once per worker (the experiments' model cache) and a row computed on a worker is the
row computed locally, timings and the worker's own machine columns aside. Rows go back to the driver, which alone
writes results/ (through `done`): no shared filesystem is needed.

A worker process that dies is restarted and its unit computed again (`max_retries` times). An exception in a unit is
that unit's error, as in the serial executor (kvlib.study.executor): the others go on, and the run ends in `UnitsFailed`.

Without an address the executor starts a Ray instance on this machine (dashboard off; Ray >= 2.52 turns its token
authentication on for it); with one it joins that cluster and leaves it running.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path

from kvlib.errors import UserError
from kvlib.study.executor import Unit, UnitsFailed, compute_unit, error_text, machine_metadata, report_failure


def _ray():
    try:
        import ray
    except ImportError:
        raise UserError("the Ray executor needs Ray: pip install -e '.[distributed]'") from None
    return ray


class _Worker:
    """Lives in one worker process: the experiments' model cache persists across the units it computes."""

    def __init__(self, threads: int):
        import torch

        torch.set_num_threads(threads)  # the CPUs it holds, not every core of a machine other workers share

    def ready(self) -> dict:
        return {"pid": os.getpid(), **machine_metadata()}

    def compute(self, point, repeat: int, meta: dict):
        """(rows, None), or (None, the error with its traceback): an exception is a result, not a retry."""
        try:
            return compute_unit(point, repeat, {**meta, **machine_metadata()}), None
        except Exception as exc:  # noqa: BLE001 -- any exception of a unit is that unit's recorded error
            return None, error_text(exc)


class RayExecutor:
    """Units on a Ray cluster: `address` joins a running one (`ray start --head` prints it; "auto" finds one on this
    machine); None starts one here. Each worker reserves `cpus_per_point` CPUs and `gpus_per_point` GPUs (fractions
    share a GPU); `workers` caps how many run at once (default: as many as the cluster's resources fit)."""

    def __init__(self, address: str | None = None, gpus_per_point: float = 0, cpus_per_point: float = 1,
                 workers: int | None = None, max_retries: int = 3, runtime_env: dict | None = None):
        if cpus_per_point <= 0 or gpus_per_point < 0:
            raise UserError(f"--cpus-per-point must be > 0 and --gpus-per-point >= 0, got {cpus_per_point} and "
                            f"{gpus_per_point}")
        self.address, self.gpus, self.cpus = address, gpus_per_point, cpus_per_point
        self.workers, self.max_retries, self.runtime_env = workers, max_retries, runtime_env
        self.submitted = 0  # units handed to workers over this executor's life, retries not counted

    def _connect(self, ray) -> bool:
        """Connect to (or start) Ray; True when this call started it (and so shuts it down)."""
        if ray.is_initialized():
            return False
        if self.address is not None:
            ray.init(address=self.address, log_to_driver=True)
            return True
        # a new local instance: its workers import the kvlib this driver runs
        here = str(Path(__file__).resolve().parents[2])  # the folder holding the kvlib package
        path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        ray.init(include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
        return True

    def _pool_size(self, ray, units: int) -> int:
        if self.workers is not None:
            return max(1, min(self.workers, units))
        resources = ray.cluster_resources()
        fit = int(resources.get("CPU", 0) // self.cpus)
        if self.gpus:
            fit = min(fit, int(resources.get("GPU", 0) // self.gpus))
            if fit < 1:
                raise UserError(f"the Ray cluster has {resources.get('GPU', 0)} GPU(s): none fits a point asking for "
                                f"{self.gpus}")
        return max(1, min(fit, units))

    def run(self, units: list[Unit], meta: dict, done) -> None:
        if not units:
            return  # nothing missing: no cluster is even contacted
        ray = _ray()
        started = self._connect(ray)
        try:
            self._run(ray, units, meta, done)
        finally:
            if started:
                ray.shutdown()

    def _run(self, ray, units, meta, done) -> None:
        options = {"num_cpus": self.cpus, "num_gpus": self.gpus, "max_restarts": self.max_retries,
                   "max_task_retries": self.max_retries}
        if self.runtime_env:
            options["runtime_env"] = self.runtime_env
        actor = ray.remote(**options)(_Worker)
        threads = max(1, int(self.cpus))
        workers = [actor.remote(threads) for _ in range(self._pool_size(ray, len(units)))]
        try:
            self._schedule(ray, workers, units, meta, done)
        finally:  # their CPUs and GPUs go back now, not whenever the handles are collected
            for worker in workers:
                ray.kill(worker)

    def _schedule(self, ray, workers, units, meta, done) -> None:
        """Each worker computes one unit at a time, so a slow point holds up no queue behind it."""
        idle, queue, pending, failures = list(workers), deque(units), {}, []
        while queue or pending:
            while idle and queue:
                worker, (point, repeat) = idle.pop(), queue.popleft()
                pending[worker.compute.remote(point, repeat, meta)] = (worker, point, repeat)
                self.submitted += 1
            if not pending:  # every worker is gone: what is left cannot run
                failures += [(p, r, "no Ray worker left to compute it") for p, r in queue]
                break
            [ref], _ = ray.wait(list(pending), num_returns=1)
            worker, point, repeat = pending.pop(ref)
            try:
                rows, error = ray.get(ref)
                idle.append(worker)
            except ray.exceptions.RayError as exc:  # the worker died more often than retried
                rows, error = None, f"worker lost after {self.max_retries} retries: {exc}"
                if not isinstance(exc, ray.exceptions.RayActorError):
                    idle.append(worker)
            if error is None:
                done(point, repeat, rows)
            else:
                failures.append((point, repeat, error))
                report_failure(point, repeat, error)
        if failures:
            raise UnitsFailed(failures, len(units))
