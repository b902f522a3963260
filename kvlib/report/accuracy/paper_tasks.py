"""Finding 4 as the paper states it (its Fig. 7): the six lm-eval log-likelihood benchmarks, under the official
harnesses' protocol (`one_pass`: one dense masked pass per request, the protocol the paper's numbers came from), H2O
under FlexGen's rule (the paper's code: heavy = recent = int(budget x tokens)), InfiniGen at its official alpha, every
drop AVERAGED OVER TASKS as the paper averages it (each task whose full cache passes the validity gate weighs 1/k:
kvlib.report.stats.task_average), items resampled within their task, paired by doc_id. Eight declared claims:

1-2. H2O and InfiniGen at budget 0.5 near the full cache: the task average within +-5 pp (near_baseline);
3. InfiniGen at 0.1 loses ~6 pp on the task average: inside 1-11 pp (in_range, the margin either side);
4. H2O loses more than InfiniGen at 0.1: the task average of H2O's change from InfiniGen a loss (loses_more);
5-6. at the smallest budget run at or below 0.04, each policy approaches random guessing: the task average of its
     score less each task's chance rate within +-5 pp (near_baseline; refuted where it stays more than 5 pp above);
7-8. at budget 0.3 each policy within 10 pp of the full cache on most tasks: confirmed where more than half the gated
     tasks' drops have their interval below 10 pp, refuted where at least half have it above (each task's interval at
     the claim's level divided among the k tasks: the stratified analytic interval of one task, a bootstrap's tails
     at that level needing hundreds of thousands of draws).

Other readings stand beside, labelled, never pooled into the verdict (kvlib.report.accuracy.paper_beside)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvlib.report import stats
from kvlib.report.claims import (
    INFINIGEN_ACCURACY_DROP,
    MARGIN,
    NAMES,
    NEAR,
    NO_VALID_BASELINE,
    Claims,
    DropClaim,
    as_difference,
    in_range,
    loses_more,
    near_baseline,
    reach,
    side,
    units_needed,
)
from kvlib.report.drop_words import signed_pp
from kvlib.report.gate import accuracy_gate, beyond_model, passing
from kvlib.report.measures import budgeted
from kvlib.report.provenance import model_name
from kvlib.report.stats import CONFIRMED, INCONCLUSIVE, REFUTED
from kvlib.settings import ONE_PASS

PAPER_TASKS = ("piqa", "copa", "winogrande", "hellaswag", "openbookqa", "boolq")  # in Fig. 7's panel order
PROTOCOL = ONE_PASS  # the official harnesses' protocol, the paper's numbers' own
RULE, OTHER_RULE = "flexgen", "seen"  # H2O's budget rules: the official code's (the verdict's), the paper's words
ALPHA = 5.0  # InfiniGen's official alpha (the verdict's); alpha inf attends exactly its budget's share
SMALLEST, MODERATE, WITHIN = 0.04, 0.3, 0.10  # "2-4 % budgets"; "budget >= 0.3 within 10 pp"
ITEM = ["task", "doc_id"]
SCALE = ("models 16-60x smaller than the paper's Llama-3.1-8B, their 4-bit GGUF weights dequantized to fp32: a "
         "reading of the paper's protocol on them, not of its model")
CLAIMS = ("h2o at budget 0.5 near the full cache", "infinigen at budget 0.5 near the full cache",
          f"infinigen at budget 0.1 loses ~{INFINIGEN_ACCURACY_DROP * 100:g} pp on the task average",
          "H2O loses more than InfiniGen at budget 0.1", "h2o at a 2-4 % budget approaches random guessing",
          "infinigen at a 2-4 % budget approaches random guessing",
          f"h2o at budget {MODERATE:g} within {WITHIN * 100:g} pp on most tasks",
          f"infinigen at budget {MODERATE:g} within {WITHIN * 100:g} pp on most tasks")


def described(drop: stats.Drop) -> str:
    """A drop as a description, no verdict word: the score's move in pp and its interval."""
    return f"{signed_pp(drop.drop)} pp, interval {signed_pp(drop.high)} to {signed_pp(drop.low)}"


def _shares(at: pd.DataFrame) -> pd.Series:
    """Each task's mean share of the causal entries a point's scored rows attended (measured); empty where the rows do
    not record it."""
    if "kv_share_attended" not in at:
        return pd.Series(dtype=float)
    return at.groupby("task")["kv_share_attended"].mean().dropna()


def share(at: pd.DataFrame) -> float:
    """A point's attended share averaged over tasks, as the drops are; nan where the rows do not record it."""
    by_task = _shares(at)
    return float(by_task.mean()) if not by_task.empty else math.nan


def attended(at: pd.DataFrame, who: str = "") -> str:
    """What a point attended, for its claim's words: the task average of its measured share and, where the tasks
    differ, their range (InfiniGen's official rule caps no row of an item where int(budget x tokens) is 0: a short
    item at a 2-4 % budget attends every entry)."""
    by_task = _shares(at)
    if by_task.empty:
        return f"{who}share attended not recorded"
    mean = by_task.mean()
    spread = f", {by_task.min():.0%} to {by_task.max():.0%} by task" if by_task.max() - by_task.min() >= 0.01 else ""
    return f"{who}attended {mean:.0%} of the causal entries{spread}"


def paper_rows(df: pd.DataFrame, protocol: str | None = PROTOCOL) -> pd.DataFrame:
    """The paper's six tasks' rows, budgeted; under `protocol` where the rows record one (None: every protocol)."""
    d = df[df["task"].isin(PAPER_TASKS)] if "task" in df else df.iloc[0:0]
    if protocol and "protocol" in d:
        d = d[d["protocol"] == protocol]
    return budgeted(d).assign(correct=d["correct"].astype(float)) if not d.empty else budgeted(d)


def own_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The book's own tasks' rows (kvlib_recall, RULER...): everything but the paper's six."""
    return df[~df["task"].isin(PAPER_TASKS)] if "task" in df else df


def reading_model(d: pd.DataFrame) -> str | None:
    """The model the verdict reads: the one with the most rows (several are never pooled)."""
    if "model" not in d or d["model"].isna().all():
        return None
    return str(d["model"].value_counts().index[0])


def read_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The paper's six tasks' rows (protocol one_pass) of the one model finding 4 reads (`reading_model`)."""
    d = paper_rows(df)
    model = reading_model(d)
    return d[d["model"] == model] if model is not None else d


def point(d: pd.DataFrame, policy: str, budget: float | None = None, rule: str = RULE,
          alpha: float = ALPHA) -> pd.DataFrame:
    """One grid point's rows: H2O under `rule`, InfiniGen at `alpha`, where the rows record them (older rows that do
    not are each policy's one point)."""
    at = d[d["policy"] == policy]
    if budget is not None:
        at = at[np.isclose(at["budget"].astype(float), budget)]
    if policy == "h2o" and "budget_rule" in at and at["budget_rule"].notna().any():
        at = at[at["budget_rule"] == rule]
    if policy == "infinigen" and "alpha" in at and at["alpha"].notna().any():
        values = at["alpha"].astype(float)
        at = at[np.isinf(values) if math.isinf(alpha) else np.isclose(values, alpha)]
    return at


def gated_tasks(d: pd.DataFrame, gate: float) -> tuple[list[str], list[str]]:
    """The paper's tasks whose full cache passes (above chance: its Wilson lower bound), and why each other one is
    left out."""
    frame = accuracy_gate(d, gate)
    ok = [t for t in PAPER_TASKS if t in passing(frame, "task")]
    out = beyond_model(frame, gate)
    out += [f"Ours: task {t} did not run with the full cache here: left out" for t in PAPER_TASKS
            if t not in set(frame["task"])]
    return ok, out


def _most_tasks(d: pd.DataFrame, policy: str, tasks: list[str], level: float) -> tuple[DropClaim, list[str]]:
    """Claims 7-8: each gated task's drop at budget 0.3, its interval at the claim's level divided among the tasks."""
    full, at = d[d["policy"] == "full"], point(d, policy, MODERATE)
    each = 1 - (1 - level) / max(len(tasks), 1)
    drops = {t: stats.task_average_drop(full[full["task"] == t], at[at["task"] == t], "correct", ITEM, level=each,
                                        analytic=True)
             for t in tasks if not at[at["task"] == t].empty}
    within = sum(dr.high < WITHIN for dr in drops.values())
    beyond = sum(dr.low > WITHIN for dr in drops.values())
    k = len(tasks)
    verdict = CONFIRMED if within > k / 2 else REFUTED if beyond >= k / 2 else INCONCLUSIVE
    average = stats.task_average_drop(full, at, "correct", ITEM, level=level)
    name = (f"{policy} at budget {MODERATE:g} within {WITHIN * 100:g} pp on most tasks ({within} of {k} gated tasks' "
            f"drops with their interval below {WITHIN * 100:g} pp, {beyond} above; each at {each:.2%}; task average; "
            f"{attended(at)})")
    lines = [f"{policy} at budget {MODERATE:g}, {t}: {described(dr)}" for t, dr in drops.items()]
    return (DropClaim(name, average, verdict, "items", f"{NAMES[policy]} at budget {MODERATE:g} loses more than "
                      f"{WITHIN * 100:g} pp on at least half the tasks"), lines)


def _chance_claim(d: pd.DataFrame, policy: str, level: float) -> DropClaim | None:
    """Claims 5-6: at the smallest budget <= 0.04 the policy ran, its task-average score less the tasks' average
    chance rate, within +-5 pp."""
    budgets = sorted(b for b in point(d, policy)["budget"].unique() if b <= SMALLEST + 1e-9)
    if not budgets:
        return None
    at = point(d, policy, budgets[0]).dropna(subset=["chance"])
    if at.empty:
        return None
    means = at.groupby("task")[["correct", "chance"]].mean().astype(float).mean()
    drop = stats.task_average(at["correct"] - at["chance"].astype(float), at["task"], means["correct"],
                              means["chance"], level)
    return DropClaim(f"{policy} at a 2-4 % budget approaches random guessing (budget {budgets[0]:g}: its task "
                     f"average less the tasks' average chance rate, within +-{MARGIN * 100:g} pp; {attended(at)})",
                     drop, near_baseline(drop), "items",
                     f"{NAMES[policy]} at budget {budgets[0]:g} stays more than {MARGIN * 100:g} pp above guessing")


def _core_claims(d: pd.DataFrame, level: float) -> tuple[list[DropClaim], list[str]]:
    """Claims 1-4 (the task averages at 0.5 and 0.1); the names of those the rows cannot test, with why."""
    full, claims, untested = d[d["policy"] == "full"], [], []

    def drop(reference, other):
        return stats.task_average_drop(reference, other, "correct", ITEM, level=level)

    for policy in ("h2o", "infinigen"):
        at = point(d, policy, 0.5)
        if at.empty:
            untested.append(f"{policy} at budget 0.5 near the full cache (no {policy} rows at 0.5)")
            continue
        dr = drop(full, at)
        claims.append(DropClaim(f"{policy} at budget 0.5 near the full cache (+-{MARGIN * 100:g} pp, task average; "
                                f"{attended(at)})",
                                dr, near_baseline(dr), "items", side(dr, -MARGIN, MARGIN, f"{NAMES[policy]} at 0.5")))
    ig, h2o = point(d, "infinigen", 0.1), point(d, "h2o", 0.1)
    low, high = INFINIGEN_ACCURACY_DROP - MARGIN, INFINIGEN_ACCURACY_DROP + MARGIN
    if ig.empty:
        untested.append(f"{CLAIMS[2]} (no InfiniGen rows at alpha {ALPHA:g}, budget 0.1)")
    else:
        dr = drop(full, ig)
        claims.append(DropClaim(f"{CLAIMS[2]} (inside {low * 100:g}-{high * 100:g} pp; {attended(ig)})", dr,
                                in_range(dr, INFINIGEN_ACCURACY_DROP, INFINIGEN_ACCURACY_DROP), "items",
                                side(dr, low, high, "InfiniGen at budget 0.1")))
    if ig.empty or h2o.empty:
        untested.append(f"{CLAIMS[3]} (H2O under {RULE} or InfiniGen at alpha {ALPHA:g} did not run at 0.1)")
    else:
        dr = as_difference(drop(ig, h2o))
        claims.append(DropClaim(f"{CLAIMS[3]} (task average of H2O's change from InfiniGen; {attended(h2o, 'H2O ')}, "
                                f"{attended(ig, 'InfiniGen ')})", dr, loses_more(dr),
                                "items", "H2O loses less than InfiniGen at budget 0.1, not more"))
    return claims, untested


def paper_claims(df: pd.DataFrame, gate: float, level: float) -> tuple[Claims, pd.DataFrame, list[str]]:
    """Finding 4's eight claims on the paper's tasks (one model, protocol one_pass), the rows they read (the gated
    tasks, that model) and the gated tasks; claims these rows cannot test are `untested`, each with why."""
    d = read_rows(df)
    model = reading_model(d)
    if d.empty or "full" not in set(d["policy"]):
        why = "no full-cache rows of the paper's six tasks under protocol one_pass"
        return Claims([], [], untested=tuple(f"{c} ({why})" for c in CLAIMS)), d, []
    tasks, left_out = gated_tasks(d, gate)
    head = [(f"finding 4 read on the paper's tasks with {model or 'an unrecorded model'} ({SCALE}), protocol "
            f"{PROTOCOL}, H2O under the {RULE} rule, InfiniGen at alpha {ALPHA:g}; each gated task weighs 1/k")] \
        + left_out
    if not tasks:
        why = ("no paper task's full cache passes the validity gate (above chance: the lower end of its 95 % Wilson "
               "interval): " + " ".join(left_out))
        return Claims([], head, (NO_VALID_BASELINE, why)), d, []
    d = d[d["task"].isin(tasks)]
    full = d[d["policy"] == "full"]
    head += [f"{t}: full cache {full.loc[full['task'] == t, 'correct'].mean():.1%} on "
             f"{int((full['task'] == t).sum())} items (chance {full.loc[full['task'] == t, 'chance'].iloc[0]:.0%})"
             for t in tasks]
    claims, untested = _core_claims(d, level)
    for policy in ("h2o", "infinigen"):
        c = _chance_claim(d, policy, level)
        claims += [c] if c else []
        untested += [] if c else [(f"{CLAIMS[4 + (policy == 'infinigen')]} (no {policy} point at a budget <= "
                                  f"{SMALLEST:g} with chance rates)")]
    for policy in ("h2o", "infinigen"):
        if point(d, policy, MODERATE).empty:
            untested.append(f"{CLAIMS[6 + (policy == 'infinigen')]} (no {policy} rows at {MODERATE:g})")
            continue
        claim, lines = _most_tasks(d, policy, tasks, level)
        claims.append(claim)
        head += lines
    n = int(effective_units(d, tasks))
    floor = stats.resolution(n, level)
    head += [reach(f"~{INFINIGEN_ACCURACY_DROP * 100:g} pp on the task average", f"InfiniGen loses the paper's "
                   f"{INFINIGEN_ACCURACY_DROP * 100:g} pp on every task", units_needed(level, low_high()[0],
                   low_high()[1], INFINIGEN_ACCURACY_DROP), f"{len(tasks)} tasks worth {n:,} items", floor, level,
                   "items (effective, the tasks weighed equally)"),
             reach(f"near the full cache (+-{MARGIN * 100:g} pp)", f"the policy loses {NEAR * 100:g} pp",
                   units_needed(level, -MARGIN, MARGIN, NEAR), f"{n:,} effective items", floor, level, "items")]
    reach_of = model_name(model) if model else "the model"
    limits = ((f"only {len(tasks)} of the paper's {len(PAPER_TASKS)} tasks within {reach_of}'s reach (its full cache "
               "above chance)"),) if len(tasks) < len(PAPER_TASKS) else ()
    return Claims(claims, head, untested=tuple(untested), limits=limits), d, tasks


def low_high() -> tuple[float, float]:
    return INFINIGEN_ACCURACY_DROP - MARGIN, INFINIGEN_ACCURACY_DROP + MARGIN


def effective_units(d: pd.DataFrame, tasks: list[str]) -> float:
    """The effective items of the task average over `tasks` (the full cache's items per task)."""
    full = d[d["policy"] == "full"]
    return stats.effective_items(int((full["task"] == t).sum()) for t in tasks)
