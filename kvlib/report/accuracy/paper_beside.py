"""Finding 4 whole: its verdict on the paper's tasks (kvlib.report.accuracy.paper_tasks) and, beside it, labelled and never
pooled into it, the other readings: H2O under the paper's words' rule (`seen`: budget x tokens in all, where FlexGen's
code keeps about twice that), InfiniGen at the share of the entries H2O attended, both measured ("H2O loses more" read
at equal entries as well as at equal budget words), kvlib's deployed scoring of the same tasks (protocol `strict`),
each task's own drops, the same drops on every model of the rows (kvlib.report.accuracy.paper_sizes: their trend with
model size), and the book's own tasks (kvlib_recall, RULER), pooled item by item as the book reads them: its
extension, not the paper's claim."""

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
    share,
)
from kvlib.report.claims import Claims
from kvlib.report.gate import passing_units
from kvlib.report.measures import accuracy_item
from kvlib.report.pages import FINDINGS

BESIDE = "beside, not in the verdict"
LOW_BUDGET = 0.1  # "H2O loses more than InfiniGen at budget 0.1"


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


def _infinigen_points(d: pd.DataFrame) -> list[tuple[str, pd.DataFrame, float]]:
    """Every InfiniGen point of the rows (any alpha, any budget): its label, rows and measured share."""
    ig = d[d["policy"] == "infinigen"]
    alphas = ig["alpha"].astype(float).fillna(ALPHA) if "alpha" in ig else pd.Series(ALPHA, index=ig.index)
    return [(f"alpha {alpha:g}, budget {budget:g}", rows, share(rows))
            for (alpha, budget), rows in ig.groupby([alphas, ig["budget"].astype(float)])]


def equal_share_lines(d: pd.DataFrame, level: float) -> list[str]:
    """H2O at budget 0.1 (the claim's), under each rule, against InfiniGen at the share of the causal entries H2O
    attended, both measured: the InfiniGen point within 5 % of it, or, where none is, the two that bracket it. Against
    the nearest at or below H2O's share InfiniGen reads no more entries than H2O, so a loss of H2O's there is a loss at
    equal entries too (if fewer entries never help); against the one above, the comparison favours InfiniGen."""
    points = [p for p in _infinigen_points(d) if not np.isnan(p[2])]
    lines = []
    for rule in (RULE, OTHER_RULE):
        h2o = point(d, "h2o", LOW_BUDGET, rule=rule)
        if h2o.empty or np.isnan(kept := share(h2o)) or not points:
            continue
        equal = [p for p in points if np.isclose(p[2], kept, rtol=0.05)]
        below = max((p for p in points if p[2] <= kept), key=lambda p: p[2], default=None)
        above = min((p for p in points if p[2] > kept), key=lambda p: p[2], default=None)
        pairs = ([("at equal entries", equal[0])] if equal else
                 [(name, p) for name, p in (("on no more entries", below), ("on more entries", above)) if p])
        parts = [f"against InfiniGen {name} ({label}: {ig_share:.1%}), {described(_average(rows, h2o, level))}"
                 for name, (label, rows, ig_share) in pairs]
        lines.append(f"{BESIDE}: H2O's change from InfiniGen at the share H2O attended (H2O {rule} at budget "
                     f"{LOW_BUDGET:g} attended {kept:.1%} of the causal entries, task average, measured; InfiniGen's "
                     f"shares measured too): " + "; ".join(parts))
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
