"""Fakes for tests/study/test_ray_executor.py, installed in every Ray worker process by the test cluster's
worker_process_setup_hook (a monkeypatch in the test process does not reach the workers).

Each experiment's run_point is wrapped (in the registry): the real one runs unless KVLIB_FAKE=1 is in the worker's
environment (the executor's runtime_env sets it per test); then a point's rows are made up from its key, the worker
process dies on KVLIB_FAKE_DIE_ON's point the first time (a marker file KVLIB_FAKE_MARKER says it did), and
KVLIB_FAKE_RAISE_ON's point raises.
"""

import dataclasses
import functools
import os
from pathlib import Path

from kvlib.study.experiments import REGISTRY

__all__ = ["install"]


def fake_run_point(point, kept=None) -> list[dict]:
    if point.key == os.environ.get("KVLIB_FAKE_DIE_ON"):
        marker = Path(os.environ["KVLIB_FAKE_MARKER"])
        if not marker.exists():
            marker.write_text(str(os.getpid()))
            os._exit(1)  # the worker process dies mid-grid, as a machine lost or an OOM kill would
    if point.key == os.environ.get("KVLIB_FAKE_RAISE_ON"):
        raise ValueError(f"out of memory at {point.key}")
    return [{"value": int(point.key[:8], 16) % 1000, "oom": False, "ttft_s": 0.1}]


def dispatch(real, point, kept):
    return fake_run_point(point, kept) if os.environ.get("KVLIB_FAKE") == "1" else real(point, kept)


def install() -> None:
    """Every registered experiment's run_point wrapped, as its declaration holds it (kvlib.study.experiment)."""
    for name, experiment in list(REGISTRY.items()):
        REGISTRY[name] = dataclasses.replace(experiment, run_point=functools.partial(dispatch, experiment.run_point))
