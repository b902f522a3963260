"""The chooser's "about N items would resolve it" (kvlib.report.choose.evidence.items_for_power): at N items an
interval of the same level excludes the tolerance in at least 80 % of repeated experiments, if the measured drop is
the true one (the rule that made the expected half-width equal the distance gave 50 %)."""

from statistics import NormalDist

import numpy as np
import pytest

from kvlib.report import stats
from kvlib.report.choose.evidence import items_for_power


@pytest.mark.parametrize(("true_drop", "tolerance", "level"), [(0.10, 5.0, 0.95), (0.02, 5.0, 0.95),
                                                                (0.12, 5.0, 0.996)])
def test_the_suggested_items_settle_it_four_times_in_five(true_drop, tolerance, level):
    sd, n = 0.4, 40  # per-item spread of the paired difference; the items measured so far
    z = NormalDist().inv_cdf(1 - (1 - level) / 2)
    half = z * sd / np.sqrt(n)
    measured = stats.Drop(reference=1.0, score=1 - true_drop, drop=true_drop, low=true_drop - half,
                          high=true_drop + half, items=n, clusters=n, level=level, paired=True,
                          verdict=stats.INCONCLUSIVE)
    needed = items_for_power(measured, tolerance)
    rng = np.random.default_rng(0)
    estimates = rng.normal(true_drop, sd / np.sqrt(needed), 40_000)  # the drop measured again at `needed` items
    width = z * sd / np.sqrt(needed)
    t = tolerance / 100
    settled = (estimates - width > t) if true_drop > t else (estimates + width < t)
    assert settled.mean() >= 0.79  # 80 % up to the simulation's own scatter (+-0.2 %)
    old = int(np.ceil(n * (half / abs(true_drop - t)) ** 2))  # the old rule: the expected half-width at the distance
    again = rng.normal(true_drop, sd / np.sqrt(old), 40_000)
    old_width = z * sd / np.sqrt(old)
    old_settled = (again - old_width > t) if true_drop > t else (again + old_width < t)
    assert 0.45 <= old_settled.mean() <= 0.55
