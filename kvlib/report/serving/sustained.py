"""The sustained rate: the highest measured request rate a runner sustains under the SLO (the rule in
kvlib.report.serving's docstring)."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from kvlib.report.serving.frame import serving_frame

ATTAINMENT = 0.9  # the share of requests within the SLO a sustained rate needs


@dataclass
class Sustained:
    """The highest measured rate a runner sustains under the SLO, and what it measured there."""

    policy: str
    rate: float | None  # None: it fails at the lowest rate measured
    lowest: float
    highest: float  # the grid's highest rate for this runner
    row: dict  # the medians at `rate` (empty where rate is None)

    @property
    def at_least(self) -> bool:
        """It sustains the grid's highest rate: its limit lies beyond what was measured."""
        return self.rate is not None and self.rate >= self.highest

    def text(self) -> str:
        if self.rate is None:
            return f"below {self.lowest:.3g} requests/s (the lowest rate measured)"
        return f"{'at least ' if self.at_least else ''}{self.rate:.3g} requests/s"


def passes(g: pd.DataFrame, attainment: float = ATTAINMENT) -> bool:
    """One point's repeats: completed, in memory, and the median share within the SLO at least `attainment`."""
    if g.empty or g["oom"].any():
        return False
    if "completed" in g and not g["completed"].fillna(False).astype(bool).all():
        return False
    share = pd.to_numeric(g["slo_attainment"], errors="coerce").median()
    return bool(share >= attainment - 1e-9)  # a share of requests: 9 of 10 is 0.9, however it was rounded


def sustained_rates(df: pd.DataFrame, attainment: float = ATTAINMENT) -> dict[str, Sustained]:
    """Per runner, the highest measured rate it sustains, by the rule in kvlib.report.serving's docstring."""
    d = serving_frame(df)
    out = {}
    for policy, g in d.groupby("policy"):
        rates = sorted(g["request_rate"].unique())
        best = None
        for rate in rates:
            if not passes(g[g["request_rate"] == rate], attainment):
                break
            best = rate
        at = g[(g["request_rate"] == best) & ~g["oom"]] if best is not None else g.iloc[:0]
        row = at.median(numeric_only=True).to_dict() if not at.empty else {}
        out[policy] = Sustained(policy, None if best is None else float(best), float(rates[0]), float(rates[-1]), row)
    return out
