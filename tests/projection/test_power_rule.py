"""The chooser's "about N items would resolve it" (kvlib.report.choose.evidence.items_for_power): if the measured
shares of items lost and gained held, at N items the interval stats.paired_drop gives excludes the tolerance in at
least 80 % of experiments, and N is no larger than it need be (at 0.8 N it does so less often). Worked out exactly
over the counts of items lost and gained that N binary items can give, each count through stats.paired_drop
itself. The old rule scaled the measured half-width as 1 / sqrt(n); at the book's sizes that half-width is mostly the
floor (stats.resolution), which does not scale so: with no item answered differently in 50 it asked for about 3 times
the items needed (209 for 73 at 95 %), and it ignored the skew and the grid of few discrete answers (for 3 lost and 1
gained in 60 its 73 items settle it in 75 %). Every case below but the first binary one fails the old rule on one of its checks."""

import math

import numpy as np
import pandas as pd
import pytest

from kvlib.report import stats
from kvlib.report.choose.evidence import items_for_power, lost_and_gained, settled_share


def answers(lost, gained, n):
    """n items: the first `gained` answered by the policy alone, the next `lost` by the full cache alone."""
    full = np.r_[np.zeros(gained), np.ones(n - gained)]
    policy = np.r_[np.ones(gained), np.zeros(lost), np.ones(n - gained - lost)]
    return pd.DataFrame({"doc_id": range(n), "correct": full}), pd.DataFrame({"doc_id": range(n), "correct": policy})


def settles(lost, gained, n, tolerance, level, above=False):
    """Whether paired_drop's interval lies wholly beyond the tolerance (above: over it, else under it)."""
    d = stats.paired_drop(*answers(lost, gained, n), "correct", ["doc_id"], level=level)
    return d.low * 100 > tolerance if above else d.high * 100 < tolerance


def binomial(n, p, k):
    if p in (0.0, 1.0):
        return float(k == (0 if p == 0 else n))
    return math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p)
                    + (n - k) * math.log1p(-p))


def realised_power(lost, gained, n, tolerance, level):
    """The chance that paired_drop settles it on n items, each lost with chance `lost` and gained with `gained`:
    summed over the counts (b lost, c gained). For a given c, whether it settles is monotone in b (gained items come
    first, so one more lost item only raises every bootstrap replicate), so each c's threshold is found by bisection."""
    above = (lost - gained) * 100 > tolerance
    power = 0.0
    for c in range(n + 1):
        pc = binomial(n, gained, c)
        if pc < 1e-7:
            if c > n * gained:
                break
            continue
        q = lost / (1 - gained)
        low, high = 0, n - c
        yes = [b for b in (low, high) if settles(b, c, n, tolerance, level, above)]
        if not yes:
            continue
        if len(yes) == 2:
            threshold = low if above else high
        else:  # bisect between a count that settles and one that does not
            good, bad = (high, low) if above else (low, high)
            while abs(good - bad) > 1:
                mid = (good + bad) // 2
                good, bad = (mid, bad) if settles(mid, c, n, tolerance, level, above) else (good, mid)
            threshold = good
        counts = range(threshold, n - c + 1) if above else range(threshold + 1)
        power += pc * sum(binomial(n - c, q, b) for b in counts)
    return power


def measured(lost, gained, items, tolerance, level):
    full, policy = answers(lost, gained, items)
    drop = stats.paired_drop(full, policy, "correct", ["doc_id"], level=level)
    return items_for_power(drop, tolerance, *lost_and_gained(full, policy, "correct", ["doc_id"]))


@pytest.mark.parametrize("level", [0.95, 0.999])
def test_no_item_answered_differently_needs_only_what_the_floor_allows(level):
    """KIVI's and PyramidKV's case in the book: 50 items, none answered differently, a tolerance of 5 pp. The
    interval is the floor alone; N items is the first size at which it lies inside 5 pp (every experiment settles
    it), N - 1 is not (the old rule: 209 at 95 %, 1,000 at 99.9 %)."""
    needed = measured(0, 0, 50, 5.0, level)
    assert settles(0, 0, needed, 5.0, level) and not settles(0, 0, needed - 1, 5.0, level)
    assert needed == math.ceil(stats.two_sided_z(level) ** 2 * (1 / 0.05 - 1) + 1e-9)


@pytest.mark.parametrize(("lost", "gained", "items", "tolerance", "level"), [
    (2, 0, 40, 10.0, 0.95),  # the floor decides at 40 items
    (9, 0, 60, 5.0, 0.95),  # beyond the tolerance: ruled out, the sign test included
    (3, 1, 60, 12.0, 0.95),  # items lost and gained
    (2, 0, 40, 10.0, 0.99),
])
def test_the_suggested_items_settle_it_four_times_in_five_on_binary_items(lost, gained, items, tolerance, level):
    needed = measured(lost, gained, items, tolerance, level)
    shares = lost / items, gained / items
    power = realised_power(*shares, needed, tolerance, level)
    assert power >= 0.8, f"{needed} items settle it in {power:.1%}"
    assert realised_power(*shares, int(0.8 * needed), tolerance, level) < 0.8  # and no more than needed
    assert settled_share(needed, *shares, tolerance, level) == pytest.approx(power, abs=0.08)  # the rule's own model


def test_a_drop_close_to_the_tolerance_is_said_to_need_more_than_the_largest_size_worked_out():
    """2.5 % of items lost and 1.25 % gained, against 1.2 pp: about a million items. The search once doubled its way
    there, each size's chance slower than the last (the exact sign test summed binomial coefficients: minutes at
    10^5), and the chooser's page did not finish; now it stops at MOST_ITEMS and says so."""
    from kvlib.report.choose.evidence import MOST_ITEMS, items_to_resolve

    def drop(share):
        return stats.Drop(reference=1.0, score=1 - share, drop=share, low=-0.05, high=0.08, items=80, clusters=80,
                          level=0.95, paired=True, verdict=stats.INCONCLUSIVE)

    assert items_for_power(drop(0.0125), 1.2, 0.025, 0.0125) is None
    assert f"more than {MOST_ITEMS:,} items" in items_to_resolve(drop(0.0125), 1.2, 0.025, 0.0125)
    assert "at the tolerance" in items_to_resolve(drop(0.012), 1.2, 0.025, 0.0125)
    # and a size within it is still worked out: 1.25 pp against 1.0 needs some 47,000 at 95 %
    assert 40_000 < items_for_power(drop(0.0125), 1.0, 0.025, 0.0125) <= MOST_ITEMS


def test_the_sign_test_is_exact_where_it_can_be_summed_and_fast_where_it_cannot():
    assert stats.sign_test_p(9, 0) == pytest.approx(2 / 2**9, rel=1e-12)
    assert stats.sign_test_p(30, 12) == pytest.approx(2 * sum(math.comb(42, i) for i in range(13)) / 2**42, rel=1e-12)
    # 60,000 against 59,000: the normal approximation's two-sided p (continuity-corrected), to three places
    z = (60_000 - 59_000 - 1) / math.sqrt(119_000)
    assert stats.sign_test_p(60_000, 59_000) == pytest.approx(math.erfc(z / math.sqrt(2)), rel=1e-3)
