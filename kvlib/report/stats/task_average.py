"""A drop averaged over tasks, as the paper averages Fig. 7 ("InfiniGen loses ~6 pp on average"): each task's mean
paired difference, the tasks weighed equally (1/k each, however many items a task has), its interval from the same
bootstrap as `paired_drop` (kvlib.report.stats.accuracy.bootstrap_means) run within each task, the replicates of the
per-task means averaged. No interval is narrower than its items can resolve: the floor is `resolution` at the
effective number of items of an equal-weight average, k^2 / sum(1 / n_t) (the harmonic mean of the task sizes times
k). A loss or a gain also needs the exact sign test over the items, as in `paired_drop`."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvlib.report.stats.accuracy import (
    DRAWS,
    EQUIVALENCE_MARGIN,
    Drop,
    _interval,
    bootstrap_means,
    draws_for,
    drop_verdict,
    resolution,
    sign_test_p,
    two_sided_z,
)
from kvlib.report.stats.rule import ALPHA, INCONCLUSIVE, SEED


def effective_items(sizes) -> float:
    """The items an equal-weight average over tasks of these sizes is worth: k^2 / sum(1 / n_t)."""
    sizes = [n for n in sizes if n]
    return len(sizes) ** 2 / sum(1 / n for n in sizes) if sizes else 0.0


def _groups(d: pd.DataFrame) -> list[np.ndarray]:
    return [g["v"].to_numpy() for _, g in d.groupby("t", sort=True)]


def replicates(values, tasks, draws: int = DRAWS, seed: int = SEED) -> np.ndarray:
    """Bootstrap replicates of the task average of per-item `values`: items resampled within each task, each task's
    replicate mean weighing 1/k."""
    d = pd.DataFrame({"v": np.asarray(values, dtype=float), "t": list(tasks)}).dropna()
    return np.mean([bootstrap_means(g, draws=draws, seed=seed + j) for j, g in enumerate(_groups(d))], axis=0)


def task_average(values, tasks, reference=None, score=None, level: float = 1 - ALPHA,
                 margin: float = EQUIVALENCE_MARGIN, draws: int = DRAWS, seed: int = SEED,
                 analytic: bool = False) -> Drop:
    """The task average of per-item `values` (a paired difference reference - policy, or a score less its chance
    rate), each task's mean weighing 1/k, as a Drop: `drop` the average, its interval at `level` from items resampled
    within each task, `reference` and `score` the two sides' task averages where given (else the average and 0),
    `items` every item, `clusters` the effective items (rounded down). analytic: the stratified normal interval
    instead (z times sqrt(sum of var_t / n_t) / k), the same floor and sign test: for described lines and for the
    per-task intervals of a claim that divides its level among the tasks, where a bootstrap's tails would need
    hundreds of thousands of draws."""
    d = pd.DataFrame({"v": np.asarray(values, dtype=float), "t": list(tasks)}).dropna()
    if d.empty:
        return Drop(math.nan, math.nan, math.nan, math.nan, math.nan, 0, 0, level, True, INCONCLUSIVE)
    groups = _groups(d)
    estimate = float(np.mean([g.mean() for g in groups]))
    if analytic:
        half = two_sided_z(level) * math.sqrt(sum(g.var() / len(g) for g in groups)) / len(groups)
        low, high = estimate - half, estimate + half
    else:
        low, high = _interval(replicates(d["v"], d["t"], draws_for(level, draws), seed), level)
    units = effective_items(len(g) for g in groups)
    floor = resolution(math.floor(units), level)
    low, high = max(min(low, estimate - floor), -1.0), min(max(high, estimate + floor), 1.0)
    if (low > 0 or high < 0) and sign_test_p(int((d["v"] > 0).sum()), int((d["v"] < 0).sum())) > 1 - level:
        low, high = min(low, 0.0), max(high, 0.0)
    reference = estimate if reference is None else reference
    score = 0.0 if score is None else score
    return Drop(float(reference), float(score), estimate, low, high, len(d), math.floor(units), level, True,
                drop_verdict(low, high, margin))


def task_average_drop(reference: pd.DataFrame, other: pd.DataFrame, value: str, item: list[str], task: str = "task",
                      level: float = 1 - ALPHA, margin: float = EQUIVALENCE_MARGIN, draws: int = DRAWS,
                      seed: int = SEED, analytic: bool = False) -> Drop:
    """`other`'s drop from `reference` averaged over tasks (each task 1/k), rows paired on `item` (which names the
    task): the paper's "on average" over its benchmarks."""
    ref = reference.dropna(subset=[value]).drop_duplicates(item)
    joined = ref[item + [value]].merge(other.dropna(subset=[value]).drop_duplicates(item)[item + [value]], on=item,
                                       suffixes=("_ref", ""))
    if joined.empty:
        return Drop(math.nan, math.nan, math.nan, math.nan, math.nan, 0, 0, level, True, INCONCLUSIVE)
    sides = joined.groupby(task)[[f"{value}_ref", value]].mean().astype(float).mean()
    return task_average(joined[f"{value}_ref"].astype(float) - joined[value].astype(float), joined[task],
                        sides[f"{value}_ref"], sides[value], level, margin, draws, seed, analytic)
