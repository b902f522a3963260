"""A trend across independent groups (models): the least-squares slope of their estimates against x, its interval
from each group's bootstrap replicates drawn independently of the others (the slope is a weighted sum of the groups'
estimates, so each replicate's slope is that sum of one replicate of each), and no narrower than the groups' own
floors (kvlib.report.stats.resolution) carry through the same weights."""

from __future__ import annotations

import math

import numpy as np

from kvlib.report.stats.accuracy import _interval


def slope(x, estimates, replicates, floors, level: float) -> tuple[float, float, float]:
    """(slope, low, high) of `estimates` against `x`: `replicates` one array of bootstrap replicates a group (equal
    lengths), `floors` each group's least half-width."""
    x = np.asarray(x, dtype=float)
    if len(x) < 2 or np.ptp(x) == 0:
        return math.nan, math.nan, math.nan
    weights = (x - x.mean()) / ((x - x.mean()) ** 2).sum()
    estimate = float(weights @ np.asarray(estimates, dtype=float))
    low, high = _interval(weights @ np.vstack(replicates), level)
    floor = math.sqrt(sum((w * f) ** 2 for w, f in zip(weights, floors)))
    return estimate, min(low, estimate - floor), max(high, estimate + floor)
