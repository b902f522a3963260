"""What a test's worker process runs in place of a unit (kvlib.study.executor.Processes.in_worker): importable by a
spawned worker, which sees none of the test's own module."""

import os

import pandas as pd


def dies_on_task_b(point, repeat, meta) -> pd.DataFrame:
    """A worker killed from outside while on task b (as the out-of-memory killer kills it); other units' rows."""
    if point.values["task"] == "b":
        os._exit(9)
    return pd.DataFrame({"task": [point.values["task"]], "where": ["worker"]})
