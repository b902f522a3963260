"""Timing: how does A's speed compare with B's? Each side is a handful of repeated timings of one point (TTFT in s,
decode throughput in tok/s), one a round: the executor runs every point once a round, each round's points in a
seeded random order (recorded in the rows). The test is a two-sided permutation test on the logarithms of the
timings, the figure compared the ratio of geometric means (the one ratio the book quotes). Where both sides ran in
the same rounds it is read round by round: under the null, each round's two timings are exchangeable (the random
order put either side first as likely), so the test flips which side each round's log ratio belongs to (2^n
arrangements of n rounds); a slow round of the machine then weighs on both sides alike. Otherwise (rows without
rounds) the timings are two samples and the test splits their pool. Exact while the arrangements are few enough to
enumerate, PERMUTATIONS random ones beyond that. Its interval of the ratio is the set of ratios the same test does
not reject (test inversion). An exact test on few repeats is discrete: 6 rounds give 64 sign flips, so the smallest
p-value is 2/64 and a test "at 5 %" rejects only there; its real size is 3.1 % and its interval covers 96.9 %
(`attained_size`). The book states those.

Claims: a page's sentences that rank runners rest on a declared family of claims (the paper's finding 2: a handful,
not every pair). Each claim is a range the ratio is said to lie in ("A faster than B": above 1; "an order of
magnitude": 10x within a factor of sqrt(10)); it is confirmed where the test rejects both of the range's edges with
the ratio inside, refuted where it rejects the nearer edge with the ratio outside, and the family-wise error across
the family's claims is held at ALPHA by Holm's step-down rule (`holm`). Every other pair is shown as a ratio with
its interval, described, never ranked. A sameness claim is a range claim too (finding 2's "similar": within
+-EQUIVALENCE_TIMING); otherwise two runners are "not distinguishable at n repeats", never "the same".

The best of several (the chooser's answer, `compare_with_best`): the best is picked from the very timings it is
tested on, so its lead over each rival is weighed against the largest lead among the runners when their labels are
shuffled within each round (a step-down max-T), not against each pair's own null.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

import numpy as np
import pandas as pd

from kvlib.report.stats.rule import (
    ALPHA,
    CONFIRMED,
    INCONCLUSIVE,
    LARGER,
    NOT_DISTINGUISHABLE,
    REFUTED,
    SEED,
    SMALLER,
    TOO_FEW,
)

PERMUTATIONS = 4000  # random arrangements when the exact ones are more than EXACT_SPLITS
EXACT_SPLITS = 20000
EQUIVALENCE_TIMING = 0.10  # two runners' speeds "equivalent": their ratio within 1/1.1 to 1.1


@dataclass(frozen=True)
class TimingComparison:
    """A against B: the ratio of their geometric means with its interval, and the verdict (A is LARGER, SMALLER,
    NOT_DISTINGUISHABLE of B, or TOO_FEW repeats to tell). low and high are nan when there were too few repeats. paired:
    read round by round (the sign-flip test), else as two samples."""

    ratio: float
    low: float
    high: float
    n_a: int
    n_b: int
    p_value: float
    verdict: str
    exact: bool = True
    paired: bool = False

    @property
    def judged(self) -> bool:
        return self.verdict != TOO_FEW


def smallest_p_value(n_a: int, n_b: int, paired: bool = False) -> float:
    """The smallest two-sided p-value any n_a against n_b timings can give: the observed arrangement and its mirror
    image among all of them (two samples: the splits of the pooled timings, mirrored only when the sides are equal;
    paired: the 2^n sign flips of n rounds)."""
    if paired:
        return 2 / 2**n_a
    return (2 if n_a == n_b else 1) / math.comb(n_a + n_b, n_a)


def repeats_needed(alpha: float = ALPHA, paired: bool = False) -> int:
    """The fewest repeats a side with which a difference can be declared at alpha."""
    n = 2
    while smallest_p_value(n, n, paired) > alpha:
        n += 1
    return n


def attained_size(n_a: int, n_b: int, alpha: float = ALPHA, paired: bool = False) -> float:
    """The real false-positive rate of the exact permutation test of n_a against n_b timings run "at alpha": its
    p-values come in steps of the smallest one, so it rejects at the largest step at or below alpha (ties among the
    timings only make it rarer). 4 against 4 as two samples: 2/70 = 2.9 %; 6 rounds paired: 1/32 = 3.1 %. Beyond the
    exact arrangements (random ones), alpha."""
    if (2**n_a if paired else math.comb(n_a + n_b, n_a)) > EXACT_SPLITS:
        return alpha
    step = smallest_p_value(n_a, n_b, paired)
    return math.floor(alpha / step + 1e-9) * step


def timing_rule(alpha: float = ALPHA, repeats: int | None = None, paired: bool = True) -> str:
    """The timing rule and its real error rate at `repeats` rounds (or repeats a side, where the timings carry no
    rounds: not paired), in words (for the book: said once per page)."""
    rule = (f"timings are compared as ratios of geometric means with a two-sided permutation test, nominally at "
            f"{alpha * 100:g} %: round by round where both sides ran in the same rounds (each round's runs in a random "
            f"order; the test flips which side each round's pair of timings belongs to, and "
            f"{repeats_needed(alpha, True)} rounds are the fewest that can ever reject), else as two samples")
    if repeats and repeats >= 2:
        size = attained_size(repeats, repeats, alpha, paired)
        rule += (f"; at {repeats} {'rounds' if paired else 'repeats a side'} its real size is {size * 100:.1f} % and "
                 f"its intervals cover {(1 - size) * 100:.1f} %")
    return rule


def by_round(frame: pd.DataFrame, value: str) -> pd.Series:
    """A point's timings indexed by their round (the `repeat` column), so that two runners of the same rounds are
    compared round by round; as a plain sample where the rows carry no round or repeat one."""
    if "repeat" in frame and frame["repeat"].notna().all() and frame["repeat"].is_unique:
        return frame.set_index("repeat")[value].rename_axis("round")
    return frame[value].reset_index(drop=True)


@dataclass
class _Permutation:
    """The permutation test of A's log-timings against B's under the null A = B x e^shift. Paired (A and B indexed
    by the same rounds): the statistic is the mean of the per-round log ratios and the arrangements are the sign
    flips of those ratios. Two samples: the difference of the mean logs and the splits of the pooled timings. The
    first arrangement is always the observed one."""

    log_a: np.ndarray
    log_b: np.ndarray
    paired: bool
    arrangements: np.ndarray
    exact: bool

    @property
    def centre(self) -> float:
        return float(self.log_a.mean() - self.log_b.mean())

    def p(self, shift: float) -> float:
        """Two-sided p-value of the null ratio e^shift."""
        if self.paired:
            stats = self.arrangements @ (self.log_a - self.log_b - shift) / len(self.log_a)
        else:
            pooled = np.concatenate([self.log_a - shift, self.log_b])
            n_a, n_b = len(self.log_a), len(self.log_b)
            sum_a = self.arrangements @ pooled
            stats = sum_a / n_a - (pooled.sum() - sum_a) / n_b
        # a relative tolerance so that rounding never decides whether an arrangement is as extreme as the observed
        return float(np.mean(np.abs(stats) >= np.abs(stats[0]) * (1 - 1e-9) - 1e-12))

    def edge(self, alpha: float, far: float) -> float:
        """The shift between the centre (not rejected) and `far` (rejected) where the test starts rejecting."""
        centre = self.centre
        for _ in range(40):
            mid = (centre + far) / 2
            if self.p(mid) > alpha:
                centre = mid
            else:
                far = mid
        return (centre + far) / 2


def _positive(x) -> pd.Series:
    x = pd.Series(x, dtype=float).dropna()
    return x[x > 0]


def _permutation(a, b, permutations: int, seed: int) -> _Permutation | None:
    """The test for A's and B's timings: paired on their common rounds where both are indexed by rounds (by_round)
    with at least two in common, else two samples; None with fewer than two timings a side."""
    a, b = _positive(a), _positive(b)
    rounds = a.index.intersection(b.index) if a.index.name == b.index.name == "round" else []
    if len(rounds) >= 2:
        n = len(rounds)
        exact = 2**n <= EXACT_SPLITS
        if exact:
            signs = 1 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)[None, :]) & 1)
        else:
            signs = np.vstack([np.ones(n), np.random.default_rng(seed).choice([-1.0, 1.0], (permutations, n))])
        return _Permutation(np.log(a[rounds].to_numpy()), np.log(b[rounds].to_numpy()), True,
                            signs.astype(float), exact)
    if min(len(a), len(b)) < 2:
        return None
    n_a, n_b = len(a), len(b)
    n = n_a + n_b
    exact = math.comb(n, n_a) <= EXACT_SPLITS
    if exact:
        chosen = np.array(list(combinations(range(n), n_a)))
    else:
        random = np.argsort(np.random.default_rng(seed).random((permutations, n)), axis=1)[:, :n_a]
        chosen = np.vstack([np.arange(n_a)[None, :], random])
    member = np.zeros((len(chosen), n))
    np.put_along_axis(member, chosen, 1.0, axis=1)
    return _Permutation(np.log(a.to_numpy()), np.log(b.to_numpy()), False, member, exact)


def compare_timings(a, b, alpha: float = ALPHA, permutations: int = PERMUTATIONS, seed: int = SEED) -> TimingComparison:
    """A's repeated timings against B's (any positive figure: seconds, or tokens per second; indexed by round, as
    by_round gives them, to be compared round by round). The verdict says whether A is larger or smaller than B at
    the false-positive rate alpha; see the module's docstring."""
    test = _permutation(a, b, permutations, seed)
    if test is None:
        a, b = _positive(a), _positive(b)
        ratio = math.exp(np.log(a).mean() - np.log(b).mean()) if len(a) and len(b) else math.nan
        return TimingComparison(ratio, math.nan, math.nan, len(a), len(b), math.nan, TOO_FEW)
    n_a, n_b = len(test.log_a), len(test.log_b)
    centre = test.centre
    if smallest_p_value(n_a, n_b, test.paired) > alpha:
        return TimingComparison(math.exp(centre), math.nan, math.nan, n_a, n_b, math.nan, TOO_FEW,
                                paired=test.paired)
    # far enough that the shifted observed arrangement is the most extreme of all: rejected whenever anything is
    spread = test.log_a - test.log_b - centre if test.paired else np.concatenate([test.log_a - centre, test.log_b])
    reach = 4 * (np.ptp(spread) + 1.0)
    low, high = test.edge(alpha, centre - reach), test.edge(alpha, centre + reach)
    verdict = LARGER if low > 0 else SMALLER if high < 0 else NOT_DISTINGUISHABLE
    return TimingComparison(math.exp(centre), math.exp(low), math.exp(high), n_a, n_b, test.p(0.0), verdict,
                            test.exact, test.paired)


def holm(p_values, alpha: float = ALPHA) -> list[bool]:
    """Holm's step-down rule: which of a family's hypotheses are rejected with the family-wise error at alpha.
    The smallest p-value is compared with alpha / m, the next with alpha / (m - 1), ..., stopping at the first that
    fails. NaN p-values are never rejected."""
    p = [math.inf if p is None or math.isnan(p) else p for p in p_values]
    order = sorted(range(len(p)), key=lambda i: p[i])
    rejected = [False] * len(p)
    for rank, i in enumerate(order):
        if p[i] > alpha / (len(p) - rank):
            break
        rejected[i] = True
    return rejected


@dataclass(frozen=True)
class RangeClaim:
    """A claim that the ratio of A's timings to B's lies in [low, high] (high may be inf: "A larger than B").
    p_value: the evidence the claim can be settled by, tested as one member of a family (`settle`): where the
    observed ratio lies inside the range, the larger of the two edges' p-values (both edges rejected: the ratio is
    inside, the claim confirmed); outside it, the nearer edge's (rejected: the claim refuted)."""

    name: str
    ratio: float
    low: float
    high: float
    p_value: float
    inside: bool
    n_a: int
    n_b: int
    paired: bool = False

    def verdict(self, rejected: bool) -> str:
        if not rejected:
            return INCONCLUSIVE
        return CONFIRMED if self.inside else REFUTED


def range_claim(name: str, a, b, low: float, high: float = math.inf, permutations: int = PERMUTATIONS,
                seed: int = SEED) -> RangeClaim:
    """The claim "A / B lies in [low, high]" on A's and B's repeated timings (a ratio of geometric means; paired on
    their rounds where both are indexed by rounds, as compare_timings)."""
    test = _permutation(a, b, permutations, seed)
    if test is None:
        a, b = _positive(a), _positive(b)
        ratio = math.exp(np.log(a).mean() - np.log(b).mean()) if len(a) and len(b) else math.nan
        return RangeClaim(name, ratio, low, high, math.nan, low <= ratio <= high, len(a), len(b))
    ratio = math.exp(test.centre)

    def p_at(edge: float) -> float:
        return 0.0 if math.isinf(edge) else test.p(math.log(edge))

    inside = low <= ratio <= high
    p = max(p_at(low), p_at(high)) if inside else p_at(low if ratio < low else high)
    return RangeClaim(name, ratio, low, high, p, inside, len(test.log_a), len(test.log_b), test.paired)


def settle(claims: list[RangeClaim], alpha: float = ALPHA) -> list[str]:
    """Each claim's verdict with the family-wise error across the family held at alpha (Holm)."""
    return [c.verdict(r) for c, r in zip(claims, holm([c.p_value for c in claims], alpha))]


# ---- the best of several runners -----------------------------------------------------------------------------------
