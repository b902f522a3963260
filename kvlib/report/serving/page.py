"""The serving chapter's lead and its sentences as the page shows them: the paper has no arrival process to compare
with, and the rows are read per kind of machine (kvlib.report.timing.per_machine)."""

from __future__ import annotations

import pandas as pd

from kvlib.report.opening import NOTHING
from kvlib.report.serving.sentences import lines
from kvlib.report.serving.sustained import sustained_rates
from kvlib.report.timing import disturbed_note, per_machine


def lead(df: pd.DataFrame) -> str:
    if df.empty:
        return NOTHING
    rates = sustained_rates(df)
    ranked = sorted(rates.items(), key=lambda kv: -(kv[1].rate or 0))
    capacity = df["device_capacity_gb"].dropna().max() if "device_capacity_gb" in df else None
    where = f"in {capacity:g} GiB of device memory" if pd.notna(capacity) else "with no configured device capacity"
    chosen = ""
    if "rate_multiple" in df and df["rate_multiple"].notna().any():
        pairs = df.dropna(subset=["rate_multiple"]).groupby("rate_multiple")["request_rate"].first()
        chosen = (f"The rates are {', '.join(f'{m:g}x' for m in pairs.index)} this machine's service rate "
                  f"({df['service_rate'].dropna().iloc[0]:.2f} requests/s: paged serving the whole trace at once), "
                  f"that is {', '.join(f'{r:.2f}' for r in pairs)} requests/s. ")
    return (chosen + f"The highest request rate each runner sustains within the SLO {where}, measured rates only: "
            + "; ".join(f"{p} {s.text()}" for p, s in ranked) + ".")


def page_lines(df: pd.DataFrame) -> list[str]:
    """Beyond the paper (no experiment of its has arrivals): the serving sentences, per kind of machine."""
    return ["Paper: none of its experiments has an arrival process (batch scaling is a closed batch)."] \
        + per_machine(lines, df) + disturbed_note(df)
