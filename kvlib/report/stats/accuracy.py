"""Accuracy: how much does a policy lose against the full cache? Every policy answers the same items, so the drop is read
item by item (rows joined on their item ids) with a paired bootstrap interval: items resampled, or, for retention,
conversations resampled within each context-length bucket (a conversation's questions share its context; the
buckets are a design, not a sample). Across the comparisons of one page the intervals are Bonferroni-adjusted
(`family_level`), so all of them hold together at 95 %. Each comparison reads one word: "equivalent" when the whole
interval lies within +-EQUIVALENCE_MARGIN (a two one-sided tests equivalence: near the baseline), else "lower" or
"higher" when it excludes 0 and an exact sign test over the resampled units agrees, else "inconclusive". No
interval is narrower than its number of units can resolve (`resolution`: a bootstrap of identical answers has no
spread, yet two items answered alike show nothing). Rows without item ids (results from before they were recorded)
fall back to an unpaired bootstrap, said so in the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import pandas as pd
from scipy.stats import binom

from kvlib.report.stats.rule import ALPHA, EQUIVALENT, HIGHER, INCONCLUSIVE, LOWER, SEED

DRAWS = 4000  # bootstrap resamples of the accuracy drops, at least; more where an interval's tails are thin
TAIL_REPLICATES = 50  # replicates beyond each end of an interval: a quantile read from fewer is noise
EQUIVALENCE_MARGIN = 0.05  # "near the baseline": within 5 percentage points


@dataclass(frozen=True)
class Drop:
    """A policy's score against its reference's on the same items: drop = reference - score (a share: 0.12 is 12 pp
    lost), its interval at `level`, and the verdict word (the policy scores LOWER, HIGHER, EQUIVALENT or
    INCONCLUSIVE against the reference). paired: False where the rows carried no item ids to join on."""

    reference: float
    score: float
    drop: float
    low: float
    high: float
    items: int
    clusters: int
    level: float
    paired: bool
    verdict: str


def family_level(comparisons: int, alpha: float = ALPHA) -> float:
    """Each interval's level so that `comparisons` of them hold together at 1 - alpha (Bonferroni)."""
    return 1 - alpha / max(comparisons, 1)


def drop_verdict(low: float, high: float, margin: float = EQUIVALENCE_MARGIN) -> str:
    """The word for a drop's interval: near the baseline first (an interval inside +-margin answers the paper's
    question even where a small loss is measurable), then a loss or a gain that excludes 0. A claim of a difference
    reads `difference_verdict` instead: a small loss is still a loss."""
    if not math.isnan(low) and not math.isnan(high) and -margin < low and high < margin:
        return EQUIVALENT
    return difference_verdict(low, high)


def difference_verdict(low: float, high: float) -> str:
    """The word for a drop's interval read as a difference: LOWER or HIGHER where it excludes 0, else INCONCLUSIVE.
    Whether it also lies within the equivalence margin does not matter here: an extra loss of 1 to 4 pp is a loss."""
    if low > 0:
        return LOWER
    if high < 0:
        return HIGHER
    return INCONCLUSIVE  # across 0, or NaN (no pairs to read)


def bootstrap_means(values, clusters=None, strata=None, draws: int = DRAWS, seed: int = SEED) -> np.ndarray:
    """Bootstrap replicates of the mean of item values (a score, or a paired difference reference - policy): clusters
    resampled with replacement within each stratum (no clusters: every item its own; no strata: one), each replicate
    the mean over the items of the clusters drawn."""
    d = np.asarray(values, dtype=float)
    clusters = np.arange(len(d)) if clusters is None else pd.factorize(pd.Series(list(clusters)))[0]
    strata = np.zeros(len(d), dtype=int) if strata is None else pd.factorize(pd.Series(list(strata)))[0]
    per_cluster = pd.DataFrame({"cluster": clusters, "stratum": strata, "d": d}).groupby("cluster").agg(
        total=("d", "sum"), items=("d", "size"), stratum=("stratum", "first"))
    rng = np.random.default_rng(seed)
    totals, items = np.zeros(draws), np.zeros(draws)
    for _, s in per_cluster.groupby("stratum"):
        picks = rng.integers(0, len(s), size=(draws, len(s)))
        totals += s["total"].to_numpy()[picks].sum(axis=1)
        items += s["items"].to_numpy()[picks].sum(axis=1)
    return totals / items


def bootstrap_unpaired_drops(reference, other, draws: int = DRAWS, seed: int = SEED) -> np.ndarray:
    """Replicates of mean(reference) - mean(other), each side resampled on its own (no item ids to pair them)."""
    ref, oth = np.asarray(reference, dtype=float), np.asarray(other, dtype=float)
    rng = np.random.default_rng(seed)
    return (ref[rng.integers(0, len(ref), size=(draws, len(ref)))].mean(axis=1)
            - oth[rng.integers(0, len(oth), size=(draws, len(oth)))].mean(axis=1))


def draws_for(level: float, draws: int = DRAWS) -> int:
    """Enough resamples that each tail of a `level` interval holds TAIL_REPLICATES of them (a Bonferroni level of
    99.6 % leaves 0.2 % a tail: 25,000 draws, not 4,000's 8 replicates)."""
    return max(draws, math.ceil(TAIL_REPLICATES / ((1 - level) / 2)))


def _interval(replicates: np.ndarray, level: float) -> tuple[float, float]:
    tail = (1 - level) / 2
    return float(np.quantile(replicates, tail)), float(np.quantile(replicates, 1 - tail))


def normal_quantile(p: float) -> float:
    """The standard normal distribution's quantile at `p` (one-sided)."""
    return NormalDist().inv_cdf(p)


def two_sided_z(level: float) -> float:
    """The z of a two-sided interval at `level`: 1.96 at 95 %."""
    return normal_quantile(1 - (1 - level) / 2)


def resolution(clusters: int, level: float) -> float:
    """The least half-width an interval from `clusters` independent units can honestly have: with none of them
    differing, the share that could differ is still up to z^2 / (n + z^2) (Wilson's bound at zero). A bootstrap of
    identical answers has no spread at all; without this floor two items answered alike would read "equivalent"."""
    z2 = two_sided_z(level) ** 2
    return z2 / (clusters + z2) if clusters else math.inf


POWER = 0.8  # a claim's reach: the units at which it comes out confirmed this often, if the paper's effect held


def confirm_chance(effect: float, se: float, half_width: float, low: float, high: float) -> float:
    """The chance that an estimate drawn around `effect` with standard error `se` has its +-half_width interval inside
    [low, high] (a normal approximation; high may be infinite, for a claim of a difference)."""
    lo, hi = low + half_width, high - half_width
    if lo > hi:
        return 0.0
    if se == 0:
        return float(lo <= effect <= hi)
    spread = NormalDist(effect, se)
    return (1.0 if math.isinf(hi) else spread.cdf(hi)) - spread.cdf(lo)


def smallest_passing(passes, most: int | None = None) -> int | None:
    """The smallest n >= 1 for which passes(n) holds, where it fails below some n and holds from there on: n doubled
    until it holds, then bisected. None where it does not hold by `most`."""
    if most is not None and not passes(most):
        return None
    high = 1
    while not passes(high):
        high *= 2
    low = high // 2  # (0 when 1 passes: never asked)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if passes(middle) else (middle, high)
    return high


def units_for_power(chance, power: float = POWER, most: int = 10**7) -> int | None:
    """The fewest units n at which chance(n) reaches `power` (chance non-decreasing in n); None if not by `most`."""
    return smallest_passing(lambda n: chance(n) >= power, most)


def sign_test_p(positive: int, negative: int) -> float:
    """Exact two-sided sign test: the chance of a split at least this uneven among units that differ, if each were
    as likely to differ either way (McNemar's exact test, where the units are single binary items)."""
    n, k = positive + negative, min(positive, negative)
    if n == 0:
        return 1.0
    return min(1.0, 2 * float(binom.cdf(k, n, 0.5)))  # (an exact sum of binomial coefficients took minutes at 10^5)


def _floored(drop: float, low: float, high: float, clusters: int, level: float) -> tuple[float, float]:
    w = resolution(clusters, level)
    return max(min(low, drop - w), -1.0), min(max(high, drop + w), 1.0)


def _cluster_labels(frame: pd.DataFrame, cluster: list[str] | None) -> pd.Series | None:
    return frame[cluster].astype(str).agg("/".join, axis=1) if cluster else None


def mean_interval(frame: pd.DataFrame, value: str, cluster: list[str] | None = None, stratum: str | None = None,
                  level: float = 1 - ALPHA, draws: int = DRAWS, seed: int = SEED) -> tuple[float, float]:
    """A score's bootstrap interval, resampling clusters within strata as paired_drop does (retention: a whole
    conversation's questions together, within its bucket)."""
    d = frame.dropna(subset=[value])
    if d.empty:
        return math.nan, math.nan
    replicates = bootstrap_means(d[value].astype(float), _cluster_labels(d, cluster),
                                 d[stratum] if stratum else None, draws, seed)
    return _interval(replicates, level)


def _joined(reference: pd.DataFrame, other: pd.DataFrame, value: str, item: list[str], cluster: list[str] | None,
            stratum: str | None) -> pd.DataFrame | None:
    """Both sides' scores on their shared items (columns `<value>_ref` and `<value>`), or None where the rows carry
    no item ids to join on or share no item."""
    columns = set(item) | set(cluster or []) | ({stratum} if stratum else set())
    if not (columns <= set(reference.columns) and set(item) <= set(other.columns)):
        return None
    ref = reference.dropna(subset=[value]).drop_duplicates(item)
    joined = ref[sorted(columns) + [value]].merge(other.dropna(subset=[value])[item + [value]], on=item,
                                                  suffixes=("_ref", ""))
    return None if joined.empty else joined


def paired_drop(reference: pd.DataFrame, other: pd.DataFrame, value: str, item: list[str],
                cluster: list[str] | None = None, stratum: str | None = None, level: float = 1 - ALPHA,
                margin: float = EQUIVALENCE_MARGIN, draws: int = DRAWS, seed: int = SEED) -> Drop:
    """The drop of `other`'s score from `reference`'s (rows: one per item, `value` the item's score in [0, 1]),
    joined on the `item` columns; resampled by `cluster` (columns naming a cluster; none: items) within `stratum`.
    Where the item columns are missing or the rows share no item, the drop is unpaired (and says so)."""
    joined = _joined(reference, other, value, item, cluster, stratum)
    if joined is not None:
        ref_scores, scores = joined[f"{value}_ref"].astype(float), joined[value].astype(float)
        groups = _cluster_labels(joined, cluster)
        differences = ref_scores - scores
        replicates = bootstrap_means(differences, groups, joined[stratum] if stratum else None,
                                     draws_for(level, draws), seed)
        drop = float(ref_scores.mean() - scores.mean())
        per_cluster = differences.groupby(groups.to_numpy() if cluster else np.arange(len(joined))).mean()
        low, high = _floored(drop, *_interval(replicates, level), len(per_cluster), level)
        # a loss or gain also needs the exact sign test over the units (a bootstrap of 2 items both lost would
        # otherwise call it at any level): where it cannot reject, the interval reaches 0, so that the interval
        # and the word are one reading
        if (low > 0 or high < 0) and sign_test_p(int((per_cluster > 0).sum()),
                                                 int((per_cluster < 0).sum())) > 1 - level:
            low, high = min(low, 0.0), max(high, 0.0)
        verdict = drop_verdict(low, high, margin)
        return Drop(float(ref_scores.mean()), float(scores.mean()), drop, low, high, len(joined),
                    len(per_cluster), level, True, verdict)
    ref_scores = reference[value].dropna().astype(float)
    scores = other[value].dropna().astype(float)
    if ref_scores.empty or scores.empty:
        return Drop(math.nan, math.nan, math.nan, math.nan, math.nan, 0, 0, level, False, INCONCLUSIVE)
    drop, n = float(ref_scores.mean() - scores.mean()), min(len(ref_scores), len(scores))
    replicates = bootstrap_unpaired_drops(ref_scores, scores, draws_for(level, draws), seed)
    low, high = _floored(drop, *_interval(replicates, level), n, level)
    return Drop(float(ref_scores.mean()), float(scores.mean()), drop, low, high, n, n, level, False,
                drop_verdict(low, high, margin))


def drop_change(near: tuple[pd.DataFrame, pd.DataFrame], far: tuple[pd.DataFrame, pd.DataFrame], value: str,
                item: list[str], cluster: list[str] | None = None, level: float = 1 - ALPHA,
                margin: float = EQUIVALENCE_MARGIN, draws: int = DRAWS, seed: int = SEED) -> Drop:
    """How much more a policy loses against its reference in one cell of a design (`far`: (reference rows, policy
    rows), e.g. the longest context bucket) than in another (`near`), the two cells holding different items: each
    cell's paired differences resampled on their own (by `cluster`), the replicates subtracted. As a Drop: reference
    and score are 1 - the near and far cells' drops, so `drop` is far's drop less near's and LOWER reads "loses more
    in the far cell". No interval is narrower than both cells' floors together; rows without item ids give an
    inconclusive Drop (a trend needs the pairs)."""
    cells = [_joined(ref, other, value, item, cluster, None) for ref, other in (near, far)]
    if any(c is None for c in cells):
        return Drop(math.nan, math.nan, math.nan, math.nan, math.nan, 0, 0, level, False, INCONCLUSIVE)
    drops, replicates, units = [], [], []
    for offset, c in enumerate(cells):
        differences = c[f"{value}_ref"].astype(float) - c[value].astype(float)
        groups = _cluster_labels(c, cluster)
        drops.append(float(differences.mean()))
        replicates.append(bootstrap_means(differences, groups, None, draws_for(level, draws), seed + offset))
        units.append(int(groups.nunique()) if cluster else len(c))
    change = drops[1] - drops[0]
    low, high = _interval(replicates[1] - replicates[0], level)
    floor = math.hypot(resolution(units[0], level), resolution(units[1], level))
    low, high = max(min(low, change - floor), -1.0), min(max(high, change + floor), 1.0)
    return Drop(1 - drops[0], 1 - drops[1], change, low, high, sum(len(c) for c in cells), sum(units), level, True,
                drop_verdict(low, high, margin))
