"""The accuracy chapter's tables: one score per task, policy and budget with its interval (the chooser reads the same),
RULER's per subtask and length, and InfiniGen's speculation as it ran."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvlib.report.measures import ruler_rows, scored_rows, wilson

SPECULATION = {"kv_share_attended": "share of the seen entries attended", "speculation_coverage":
               "attention mass its picks carried", "oracle_coverage": "mass the best picks of that count carry",
               "speculation_recall": "recall (picks / best)"}


def _perplexity_interval(g: pd.DataFrame, draws: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95 % bootstrap interval of word perplexity, resampling the documents."""
    rng = np.random.default_rng(seed)
    loglik, words = g["loglik"].to_numpy(), g["words"].to_numpy()
    picks = rng.integers(0, len(g), size=(draws, len(g)))
    values = np.exp(-loglik[picks].sum(axis=1) / words[picks].sum(axis=1))
    return float(np.quantile(values, 0.025)), float(np.quantile(values, 0.975))


def accuracy_table(df: pd.DataFrame) -> pd.DataFrame:
    """One score per (task, policy, budget) with its 95 % interval: accuracy (Wilson) for multiple-choice tasks, word
    perplexity (bootstrap over documents) for rolling ones; and the KV share the policy actually attended while
    scoring. The full cache has no budget: it is listed at budget 1.0. RULER's rows are left to `ruler_table`."""
    d = scored_rows(df)
    rows = []
    for (task, policy, budget), g in d.groupby(["task", "policy", "budget"]):
        attended = g["kv_share_attended"].median() if "kv_share_attended" in g else math.nan
        if "correct" in g and g["correct"].notna().any():
            low, high = wilson(g["correct"].sum(), len(g))
            rows.append((task, policy, budget, attended, "accuracy", g["correct"].mean(), low, high, len(g)))
        else:
            score = math.exp(-g["loglik"].sum() / g["words"].sum())
            rows.append((task, policy, budget, attended, "word perplexity", score, *_perplexity_interval(g), len(g)))
    return pd.DataFrame(rows, columns=["task", "policy", "budget", "kv_share_attended", "metric", "score", "low",
                                       "high", "items"])


def speculation_markdown(df: pd.DataFrame) -> str:
    """InfiniGen's selection as it ran, per task and budget (its cap): the share of the seen entries its decode steps
    attended (the dense layers and each step's new token included), the true attention mass of a sparse layer its
    speculated picks carried, the mass the oracle's best picks of the same count would carry, and their ratio
    (measure_coverage; kvlib.policies.infinigen). Each point's value over all its items."""
    rows = df[df["policy"] == "infinigen"] if "policy" in df else df.iloc[:0]
    if rows.empty or "speculation_recall" not in rows or rows["speculation_recall"].isna().all():
        return "InfiniGen's speculation was not measured in these results (`measure_coverage` unset)."
    table = rows.groupby(["task", "budget"])[list(SPECULATION)].median().reset_index()
    lines = ["| task | budget (cap) | " + " | ".join(SPECULATION.values()) + " |", "|---|---|" + "---|" * len(SPECULATION)]
    for r in table.itertuples(index=False):
        lines.append(f"| {r.task} | {r.budget:g} | " + " | ".join(f"{getattr(r, c):.1%}" for c in SPECULATION) + " |")
    return "\n".join(lines)


def _bootstrap_mean(groups: list[np.ndarray], draws: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95 % bootstrap interval of the mean over groups of the groups' mean item score, resampling items within each
    group (one group: one subtask's items at one length)."""
    rng = np.random.default_rng(seed)
    means = np.mean([s[rng.integers(0, len(s), size=(draws, len(s)))].mean(axis=1) for s in groups], axis=0)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def ruler_table(df: pd.DataFrame) -> pd.DataFrame:
    """RULER: one score per (task, length, policy, budget), the mean string-match score of its items (RULER's metric,
    per item the share of expected strings found in the answer), with a 95 % bootstrap interval over the items; and a
    `mean` task per (length, policy, budget), the unweighted mean over the subtasks run there (as RULER averages its
    tasks). The full cache is listed at budget 1.0."""
    columns = ["task", "length", "policy", "budget", "kv_share_attended", "metric", "score", "low", "high", "items"]
    if "ruler_score" not in df or df["ruler_score"].isna().all():
        return pd.DataFrame(columns=columns)
    d = ruler_rows(df)
    rows = []
    for (length, policy, budget), point in d.groupby(["length", "policy", "budget"]):
        attended = point["kv_share_attended"].median() if "kv_share_attended" in point else math.nan
        groups = {task: g["ruler_score"].to_numpy(float) for task, g in point.groupby("task")}
        for task, scores in groups.items():
            rows.append((task, length, policy, budget, attended, "string match", scores.mean(),
                         *_bootstrap_mean([scores]), len(scores)))
        rows.append(("mean", length, policy, budget, attended, "string match",
                     float(np.mean([s.mean() for s in groups.values()])), *_bootstrap_mean(list(groups.values())),
                     sum(map(len, groups.values()))))
    return pd.DataFrame(rows, columns=columns)
