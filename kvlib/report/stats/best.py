"""The comparison with the best: a runner picked as the fastest from the same timings it is then tested on, against
every rival, the pick allowed for (kvlib.report.choose's ties; tests/report/test_choose_best.py simulates its error
rate)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from itertools import permutations as permutations_of
from itertools import product

import numpy as np
import pandas as pd

from kvlib.report.stats.rule import ALPHA, SEED
from kvlib.report.stats.timing import EXACT_SPLITS, PERMUTATIONS


@dataclass(frozen=True)
class BestComparison:
    """A chosen best runner against every rival measured at the same point. slower: the rivals shown slower than the
    best, the statements "the best is faster than each of them" wrong together with a chance of at most alpha, the
    pick of the best included; ties: the rest (a rival with too few timings to test among them: nothing shows it
    slower); p_values: each rival's adjusted p-value where the step-down reached it (nan: not reached or not
    tested); rounds: the rounds read (0: the timings read as samples)."""

    best: str
    slower: tuple[str, ...]
    ties: tuple[str, ...]
    p_values: dict
    rounds: int
    exact: bool


def compare_with_best(timings: pd.DataFrame, best: str, alpha: float = ALPHA, larger_is_better: bool = True,
                      permutations: int = PERMUTATIONS, seed: int = SEED) -> BestComparison:
    """`best`, picked as the best of `timings` (a column per runner; a row per round, the index named "round" as
    by_round names it, else the timings are samples, NaN where a runner has fewer), against every other runner.
    The pick is read from the same timings, so the best's lead over a rival is not weighed against that pair's own
    null, which ignores that the leader was chosen for leading, but against the largest lead between any two runners
    of a set (the range of their mean log-timings) when their labels are shuffled within each round (the executor
    ran each round's points in a random order: under the null that they are equal, every order of a round is as
    likely). Step-down, the slowest rival first: the set is the best and the rivals not yet shown slower; the first
    rival whose lead is within that set's range under shuffling stops it, it and the rest not distinguishable (so
    that a far slower runner shuffled in does not hide the lead of a near one, and among equal runners any rival is
    called slower with a chance of at most alpha: tests/report/test_choose_best.py simulates it). Read round by
    round on the rounds every runner ran (at least two), else as samples whose pooled timings are shuffled among the
    runners; exact while the arrangements are at most EXACT_SPLITS, `permutations` random ones beyond. With two
    runners it is the two-sided by-round test of compare_timings."""
    values = timings.to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.where(values > 0, np.log(values), np.nan) * (1 if larger_is_better else -1)  # larger: better
    counts = dict(zip(timings.columns, np.isfinite(logs).sum(axis=0)))
    others = sorted(p for p in timings.columns if p != best)
    testable = [p for p in others if counts[p] >= 2]
    p_values = dict.fromkeys(others, math.nan)
    if counts.get(best, 0) < 2 or not testable:
        return BestComparison(best, (), tuple(others), p_values, 0, True)
    names = [best, *testable]
    logs = logs[:, [timings.columns.get_loc(p) for p in names]]
    table = logs[np.isfinite(logs).all(axis=1)] if timings.index.name == "round" else logs[:0]  # rounds all ran
    paired = len(table) >= 2
    columns = [table[:, i] if paired else column[np.isfinite(column)] for i, column in enumerate(logs.T)]
    lead = {p: columns[0].mean() - columns[i].mean() for i, p in enumerate(names) if i}
    remaining, slower, exact, adjusted = list(range(len(names))), [], paired, 0.0
    for rival in sorted(lead, key=lead.get, reverse=True):
        spread, exact_here = _shuffled_spread([columns[i] for i in remaining], paired, permutations, seed)
        exact = exact and exact_here
        # a relative tolerance so that rounding never decides whether an arrangement is as extreme as the observed
        adjusted = max(adjusted, float(np.mean(spread >= lead[rival] * (1 - 1e-9) - 1e-12)))
        p_values[rival] = adjusted
        if adjusted > alpha:
            break
        slower.append(rival)
        remaining.remove(names.index(rival))
    return BestComparison(best, tuple(sorted(slower)), tuple(p for p in others if p not in slower), p_values,
                          len(table) if paired else 0, exact)


def _shuffled_spread(columns: list[np.ndarray], paired: bool, permutations: int, seed: int
                     ) -> tuple[np.ndarray, bool]:
    """The largest difference between the runners' mean log-timings in each arrangement of their labels (the first:
    the observed), and whether the arrangements are all of them. Paired (each column the same rounds): shuffled
    within each round; else the pooled timings shuffled among the runners."""
    if paired:
        table = np.column_stack(columns)
        orders, exact = _round_orders(*table.shape, permutations, seed)
        means = sum(row[order] for row, order in zip(table, orders)) / len(table)
    else:
        sizes = np.array([len(c) for c in columns])
        pooled = np.concatenate(columns)[_pool_orders(int(sizes.sum()), permutations, seed)]
        means, exact = np.add.reduceat(pooled, np.r_[0, np.cumsum(sizes)[:-1]], axis=1) / sizes, False
    return means.max(axis=1) - means.min(axis=1), exact


@lru_cache(maxsize=16)
def _round_orders(rounds: int, runners: int, permutations: int, seed: int) -> tuple[np.ndarray, bool]:
    """Arrangements of the runners within each round (rounds x arrangements x runners, each a permutation of the
    runners; the first arrangement the observed), and whether they are all of them (while at most EXACT_SPLITS)."""
    exact = math.factorial(runners) ** rounds <= EXACT_SPLITS
    if exact:
        one = np.array(list(permutations_of(range(runners))))
        order = one[np.array(list(product(range(len(one)), repeat=rounds)))]
    else:
        random = np.argsort(np.random.default_rng(seed).random((permutations, rounds, runners)), axis=2)
        order = np.concatenate([np.broadcast_to(np.arange(runners), (1, rounds, runners)), random])
    return np.ascontiguousarray(order.transpose(1, 0, 2)), exact


@lru_cache(maxsize=16)
def _pool_orders(n: int, permutations: int, seed: int) -> np.ndarray:
    """Random orders of n pooled timings (the first the observed)."""
    random = np.argsort(np.random.default_rng(seed).random((permutations, n)), axis=1)
    return np.vstack([np.arange(n)[None, :], random])


# ---- accuracy ------------------------------------------------------------------------------------------------------
