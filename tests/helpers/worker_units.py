"""What a test's worker process runs in place of a unit (kvlib.study.executor.Processes.in_worker): importable by a
spawned worker, which sees none of the test's own module."""

import os

import pandas as pd


def dies_on_task_b(point, repeat, meta) -> pd.DataFrame:
    """A worker killed from outside while on task b (as the out-of-memory killer kills it); other units' rows."""
    if point.values["task"] == "b":
        os._exit(9)
    return pd.DataFrame({"task": [point.values["task"]], "where": ["worker"]})


def sleeps_and_says_where(point, repeat, meta) -> pd.DataFrame:
    """A long unit that first writes its worker's pid where the test reads it."""
    import time
    from pathlib import Path

    Path(point.values["pid_file"]).write_text(str(os.getpid()))
    time.sleep(120)
    return pd.DataFrame()


def study_with_a_sleeping_worker(pid_file: str) -> None:
    """A study process (run by a test as a script) that has started the outside engines' process (vLLM's) and whose
    two workers sleep in their units."""
    from pathlib import Path

    from kvlib.study import executor
    from kvlib.study.point import Point

    Path(f"{pid_file}.outside").write_text(str(executor.in_outside_process(os.getpid)))
    processes = executor.Processes(2)
    processes.in_worker = sleeps_and_says_where
    units = [(Point("accuracy", "full", {}, {"task": t, "pid_file": f"{pid_file}.{t}"}, "m"), 0) for t in "ab"]
    processes.run(units, {}, lambda *a: None)
