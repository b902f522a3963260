"""The serving results as every table, sentence and figure of the serving experiment reads them."""

from __future__ import annotations

import pandas as pd

MIB = 2**20


def serving_frame(df: pd.DataFrame) -> pd.DataFrame:
    """The rows with `oom` a boolean and the peak KV in MiB (`kv_peak_mib`, NaN where it was not booked)."""
    d = df.copy()
    d["oom"] = d["oom"].fillna(False).astype(bool) if "oom" in d else False
    kv = d["device_kv_peak_bytes"] if "device_kv_peak_bytes" in d else pd.Series(float("nan"), index=d.index)
    d["kv_peak_mib"] = pd.to_numeric(kv, errors="coerce") / MIB
    return d


def shown(x) -> str:
    """A table cell as the book shows it: 3 significant digits, blank where nothing was measured."""
    return x if isinstance(x, str) else "" if pd.isna(x) else f"{x:.3g}"


def rates_shown(index: pd.MultiIndex, level: int) -> pd.MultiIndex:
    """A table's index with its measured request rates shown as its cells are (3 significant digits)."""
    return index.set_levels(index.levels[level].map(shown), level=level)
