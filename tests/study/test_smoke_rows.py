"""The smoke grid's rows, timings aside, are what they were when they were recorded (tests/data/smoke_rows/): a change
to the engine's house (the scheduler, the kept tokens, the policy contract) that changes a booked byte, a kept token,
a counted unit of work or an accuracy score fails here, whatever the unit tests of each part say.

Every kvlib runner of the smoke profile's experiments is computed into results/smoke/ (so that the notebooks under
nbval read them rather than compute them again). Left out: the real vLLM (not kvlib's engine) and serving, whose
admissions follow the wall clock. Rows are compared on the machine kind that recorded them (the CPU flags' digest):
fp32 kernels differ across kinds in their last bits, and an eviction or an argmax can follow them.

Record again after a change that is meant to change rows (say which in the commit):
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 python tests/study/test_smoke_rows.py --record
"""

from __future__ import annotations

import gzip
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

GOLDEN = Path(__file__).parents[1] / "data" / "smoke_rows"
EXPERIMENTS = ("ttft", "batch_scaling", "decode_length", "offload", "accuracy", "retention")
# what the clock, the machine or the run's bookkeeping decide, not the engine
UNCOMPARED = re.compile(r"(_s|_s_\w+|_per_s\w*|_s_(mean|p50)|latencies_s|_per_step_s)$|^(section_|split_|machine_|"
                        r"load_avg|others_cpu|steal|disturbed|round_slot|attempts|git_sha|finished_at|device_name|"
                        r"cpu_threads|offload_dir|disk_probe|disk_read_bytes|point_hash)|_version$|page_cache|"
                        r"from_storage")


def _plain(value):
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, (np.generic,)):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def comparable(frame: pd.DataFrame) -> list[dict]:
    columns = sorted(c for c in frame.columns if not UNCOMPARED.search(c))
    rows = [{c: _plain(v) for c, v in zip(columns, row)} for row in frame[columns].itertuples(index=False)]
    return sorted(rows, key=lambda r: json.dumps(r, sort_keys=True, default=str))


def compute(experiment: str) -> tuple[list[dict], str]:
    from kvlib.policies import available
    from kvlib.study import load_profile, results
    from kvlib.study.executor import run_experiment

    run_experiment(load_profile("smoke"), experiment, force=True, progress=False, policies=available())
    frame = results.load("smoke", experiment)
    frame = frame[frame["runner"].isin(available())]
    return comparable(frame), str(frame["machine_cpu_flags_digest"].iloc[0])


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def record() -> None:
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for experiment in EXPERIMENTS:
        rows, digest = compute(experiment)
        with gzip.open(GOLDEN / f"{experiment}.json.gz", "wt") as f:
            json.dump({"cpu_flags_digest": digest, "rows": rows}, f, sort_keys=True)
        print(experiment, len(rows), "rows recorded")


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_the_smoke_grids_rows_are_unchanged(experiment):
    with gzip.open(GOLDEN / f"{experiment}.json.gz", "rt") as f:
        golden = json.load(f)
    rows, digest = compute(experiment)
    if digest != golden["cpu_flags_digest"]:
        pytest.skip(f"recorded on another machine kind (CPU flags {golden['cpu_flags_digest']}, here {digest})")
    assert len(rows) == len(golden["rows"])
    for row, before in zip(rows, golden["rows"]):
        assert set(row) == set(before), f"columns differ: {set(row) ^ set(before)}"
        changed = {c: (before[c], row[c]) for c in row if not _same(row[c], before[c])}
        assert not changed, f"{experiment}: {row.get('runner')} {changed}"


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    record()
