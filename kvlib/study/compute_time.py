"""Where a build's time went: each unit's compute time (`unit_compute_s`, every attempt of it, written by the
executor), added up by experiment and runner. A unit is one repeat of one point; its rows (an accuracy unit has one
per item) all carry the same figure, so it is counted once. A unit computed beside others (`unit_workers` processes
sharing the machine, kvlib.study.executor.Processes) counts its share of the build's wall time: its time over the
workers."""

from __future__ import annotations

import pandas as pd


def unit_times(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per unit: experiment, runner, point_hash, repeat and unit_compute_s, its share of the build's wall time
    (units written before the column existed are left out)."""
    columns = ["experiment", "runner", "point_hash", "repeat", "unit_compute_s"]
    if frame.empty or "unit_compute_s" not in frame.columns:
        return pd.DataFrame(columns=columns)
    units = frame.dropna(subset=["unit_compute_s"]).drop_duplicates(["experiment", "point_hash", "repeat"])
    if "unit_workers" in units:
        units = units.assign(unit_compute_s=units["unit_compute_s"] / units["unit_workers"].fillna(1))
    return units[columns].reset_index(drop=True)


def minutes_by(frame: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Units and compute minutes grouped by `by` (columns of unit_times), the costliest first."""
    units = unit_times(frame)
    table = units.groupby(by).agg(units=("unit_compute_s", "size"), minutes=("unit_compute_s", "sum"))
    table["minutes"] /= 60
    return table.sort_values("minutes", ascending=False).reset_index()
