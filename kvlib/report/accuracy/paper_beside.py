"""Finding 4 whole: its verdict on the paper's tasks (kvlib.report.accuracy.paper_tasks) and, beside it, labelled and never
pooled into it, the other readings: H2O under the paper's words' rule (`seen`: budget x tokens in all, where FlexGen's
code keeps about twice that), InfiniGen at H2O's measured kept share (alpha inf: "H2O loses more" read at equal entries
as well as at equal budget words), kvlib's deployed scoring of the same tasks (protocol `strict`), each task's own
drops, the same drops on every model of the rows (kvlib.report.accuracy.paper_sizes: their trend with model size),
and the book's own tasks (kvlib_recall, RULER), pooled item by item as the book reads them: its extension, not the
paper's claim."""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvlib.report import stats
from kvlib.report.accuracy import paper_sizes
from kvlib.report.accuracy.paper_tasks import (
    ALPHA,
    ITEM,
    OTHER_RULE,
    PAPER_TASKS,
    RULE,
    SCALE,
    described,
    paper_claims,
    paper_rows,
    point,
)
from kvlib.report.claims import Claims
from kvlib.report.gate import passing_units
from kvlib.report.measures import accuracy_item
from kvlib.report.pages import FINDINGS

BESIDE = "beside, not in the verdict"


def _average(reference: pd.DataFrame, other: pd.DataFrame, level: float) -> stats.Drop:
    """A described task average (no verdict word): the stratified analytic interval, the verdict's bootstrap kept
    for the claims."""
    return stats.task_average_drop(reference, other, "correct", ITEM, level=level, analytic=True)


def _budgets(d: pd.DataFrame, policy: str, **at) -> list[float]:
    return sorted(point(d, policy, **at)["budget"].unique(), reverse=True)


def seen_lines(d: pd.DataFrame, level: float) -> list[str]:
    """H2O under the `seen` rule at each budget it ran, its task-average drop from the full cache."""
    if "budget_rule" not in d:
        return []
    full = d[d["policy"] == "full"]
    return [f"{BESIDE}: H2O under the {OTHER_RULE} rule (the paper's words: budget x tokens kept in all; {RULE}, the "
            f"verdict's, keeps about twice that) at budget {b:g}, task average: "
            f"{described(_average(full, point(d, 'h2o', b, rule=OTHER_RULE), level))}"
            for b in _budgets(d, "h2o", rule=OTHER_RULE)]


def equal_share_lines(d: pd.DataFrame, level: float) -> list[str]:
    """H2O ({RULE}) against InfiniGen at alpha inf whose budget is the share H2O's point measured it kept."""
    if "kv_share_attended" not in d or "alpha" not in d:
        return []
    lines, capped = [], _budgets(d, "infinigen", alpha=float("inf"))
    for b in _budgets(d, "h2o"):
        h2o = point(d, "h2o", b)
        share = float(h2o["kv_share_attended"].mean())
        match = [c for c in capped if np.isclose(c, share, rtol=0.05, atol=0.005)]
        if not match:
            continue
        ig = point(d, "infinigen", match[0], alpha=float("inf"))
        lines.append(f"{BESIDE}: H2O's change from InfiniGen at equal entries (H2O {RULE} at budget {b:g} attends "
                     f"{share:.1%} of the causal entries, measured; InfiniGen with its cap binding, alpha inf, at "
                     f"budget {match[0]:g}), task average: {described(_average(ig, h2o, level))}")
    return lines


def task_lines(d: pd.DataFrame, tasks: list[str], level: float) -> list[str]:
    """Each gated task's drop at 0.5 and 0.1 for the verdict's points (the paper names per-task drops: InfiniGen's
    PIQA and OpenBookQA 17-20 pp, H2O's HellaSwag 23 pp and BoolQ 16 pp at 0.1), described."""
    full, lines = d[d["policy"] == "full"], []
    for budget in (0.5, 0.1):
        for policy in ("h2o", "infinigen"):
            at = point(d, policy, budget)
            parts = [f"{t} {described(_average(full[full['task'] == t], at[at['task'] == t], level))}"
                     for t in tasks if not at[at["task"] == t].empty]
            if parts:
                lines.append(f"per task, {policy} at budget {budget:g}: " + "; ".join(parts))
    return lines


def strict_lines(df: pd.DataFrame, model: str | None, tasks: list[str], level: float) -> list[str]:
    """The same tasks under kvlib's deployed scoring (protocol strict), where it ran: task averages, beside."""
    d = paper_rows(df, "strict") if "protocol" in df else paper_rows(df).iloc[0:0]
    d = d[d["task"].isin(tasks) & ((d["model"] == model) if model is not None and "model" in d else True)]
    full = d[d["policy"] == "full"]
    if full.empty:
        return []
    return [f"{BESIDE}: kvlib's deployed scoring (protocol strict) of the same tasks, {policy} at budget {b:g}, task "
            f"average: {described(_average(full, point(d, policy, b), level))}"
            for policy in ("h2o", "infinigen") for b in (0.5, 0.1) if not point(d, policy, b).empty]


def book_lines(df: pd.DataFrame, gate: float, level: float) -> list[str]:
    """The book's own tasks (kvlib_recall, RULER per length) pooled item by item, as the book reads them: its
    extension, context only."""
    rest = df[~df["task"].isin(PAPER_TASKS)] if "task" in df else df
    if "protocol" in rest and not rest.empty:  # a task's two protocols never pooled: strict, as RULER's units read
        several = rest.groupby("task")["protocol"].transform("nunique") > 1
        rest = rest[~several | (rest["protocol"] == "strict")]
    units = passing_units(rest, gate)
    if not units:
        return []
    pooled = pd.concat([rows.assign(score=rows[value].astype(float),
                                    stratum=label + ("/" + rows[stratum].astype(str) if stratum else ""))
                        for label, (rows, value, stratum) in units.items()], ignore_index=True)
    item, full = accuracy_item(pooled), pooled[pooled["policy"] == "full"]
    models = ", ".join(sorted(map(str, pooled["model"].dropna().unique()))) if "model" in pooled else "unrecorded"
    parts = []
    for policy in ("h2o", "infinigen"):
        for budget in (0.5, 0.1):
            at = pooled[(pooled["policy"] == policy) & np.isclose(pooled["budget"].astype(float), budget)]
            if not at.empty:
                dr = stats.paired_drop(full, at, "score", item, None, "stratum", level=level)
                parts.append(f"{policy} at budget {budget:g} {described(dr)}")
    return [f"the book's extension ({', '.join(units)}, pooled item by item, protocol strict where both ran; "
            f"{models}; not the paper's tasks, no verdict of finding 4): " + ", ".join(parts)] if parts else []


def accuracy_claims(df: pd.DataFrame, gate: float, level: float = FINDINGS.level("finding 4")) -> Claims:
    """Finding 4's eight claims as the paper states them, on its six tasks, averaged over tasks
    (kvlib.report.accuracy.paper_tasks), with every other reading beside them, the book's own tasks among them, as context
    lines that never enter the verdict."""
    if df.empty:
        return Claims([], [], ("not run in this profile", "the accuracy experiment has no results"))
    claims, d, tasks = paper_claims(df, gate, level)
    beside = book_lines(df, gate, level)
    if not tasks:
        return Claims(claims.claims, claims.context + beside, claims.unanswered, claims.untested, claims.limits)
    model = str(d["model"].iloc[0]) if "model" in d and d["model"].notna().any() else None
    extra = (task_lines(d, tasks, level) + seen_lines(d, level) + equal_share_lines(d, level)
             + strict_lines(df, model, tasks, level) + paper_sizes.lines(df, gate))
    note = (f"{BESIDE}: the lines below read the same rows ({model or 'an unrecorded model'}; {SCALE}) at other "
            f"settings (InfiniGen at alpha {ALPHA:g} unless named)")
    return Claims(claims.claims, claims.context + [note] + extra + beside, claims.unanswered, claims.untested,
                  claims.limits)
