"""How far each runner's measured decode is from its bound on the machine that measured it (kvlib.projection.bound):
the performance gauge the project steers by. A runner far above its bound has overhead to explain; the bound is the
time its counted work needs at this machine's measured limits, never an estimate of it.

The real vLLM counts nothing from inside (kvlib.backends.vllm): its bound is `full`'s counted work at the same point
(the same model and batch, every cached token read), said so in the table.
"""

from __future__ import annotations

import pandas as pd

from kvlib.report.measures import outside_label

BORROWED = "full"  # whose counts stand for an outside runner's


def with_borrowed_counts(df: pd.DataFrame) -> pd.DataFrame:
    """Rows of an outside runner given `full`'s work counts at the same point (batch size, repeat)."""
    outside = outside_label(df)
    work = [c for c in df.columns if c.startswith("stat_work_")]
    if outside is None or not work or BORROWED not in set(df["policy"]):
        return df
    counts = df[df["policy"] == BORROWED].groupby("batch_size")[work].median()
    theirs = df["policy"] == outside
    filled = df.copy()
    for column in work:
        filled.loc[theirs, column] = df.loc[theirs, "batch_size"].map(counts[column])
    return filled


def measured_over_bound(df: pd.DataFrame, spec=None) -> pd.DataFrame:
    """Per runner and batch size: the median measured decode time, the bound (overlapped) and the bound as kvlib
    schedules the runner, which floor sets it, measured / bound, and whether the bound held in every repeat."""
    from kvlib.projection.bound import bound_check

    if df.empty:
        return pd.DataFrame()
    d = df[~df["oom"].astype(bool)] if "oom" in df else df
    checked = bound_check(with_borrowed_counts(d), spec)
    if checked.empty:
        return checked
    outside = outside_label(df)
    table = checked.groupby(["runner", "batch_size"], sort=False).agg(
        measured_decode_s=("measured_decode_s", "median"), decode_bound_s=("decode_bound_s", "median"),
        bound_as_scheduled_s=("decode_bound_as_scheduled_s", "median"),
        limited_by=("bound_limited_by", "first"), measured_over_bound=("measured_over_bound", "median"),
        held_every_repeat=("holds", "all"), repeats=("holds", "size"), hardware=("hardware", "first"),
        policy=("policy", "first")).reset_index()
    table["counts"] = ["full's, at the same point" if p == outside else "its own" for p in table.pop("policy")]
    return table.sort_values(["batch_size", "measured_over_bound"]).reset_index(drop=True)
