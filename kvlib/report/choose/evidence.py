"""The accuracy evidence the chooser weighs a lossy policy by: its paired drop against the full cache on each task the
full cache passes (the validity gate), and, against a tolerance, one of three outcomes: within it, ruled out, or
"cannot tell at n items" with about how many items would resolve it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from kvlib.report import stats
from kvlib.report.gate import GATE, accuracy_gate, passing
from kvlib.report.tables import accuracy_item, accuracy_table, scored_rows

WITHIN, RULED_OUT, CANNOT_TELL = "within the tolerance", "ruled out", "cannot tell"


@dataclass
class AccuracyEvidence:
    """A lossy policy's drop against the full cache where it was read: the task whose interval decides (the largest
    upper end), the budget read, and, against a tolerance, the outcome."""

    drop: stats.Drop
    task: str
    budget: float  # the scored budget read
    where: str  # that budget, and how it stands to the policy's own where they differ
    outcome: str | None = None  # WITHIN, RULED_OUT or CANNOT_TELL, once judged against a tolerance

    def text(self, tolerance: float | None = None) -> str:
        d = self.drop
        measured = (f"measured drop {d.drop * 100:.1f} pp on {self.task} at {self.where}, {d.level:.1%} interval "
                    f"{d.low * 100:.1f} to {d.high * 100:.1f} pp over {d.items} items")
        if self.outcome == RULED_OUT:
            return f"loses more than the {tolerance:g} pp allowed ({measured}: its lower end is above it)"
        if self.outcome == CANNOT_TELL:
            return (f"cannot tell at {d.items} items whether it stays within {tolerance:g} pp: the {d.level:.1%} interval spans "
                    f"{d.low * 100:.1f} to {d.high * 100:.1f} pp (measured drop {d.drop * 100:.1f} pp on {self.task} at "
                    f"{self.where}); {items_to_resolve(d, tolerance)}")
        return measured


POWER = 0.8  # the chance the suggested size settles it, if the measured drop is the true one


def items_for_power(drop: stats.Drop, tolerance: float, power: float = POWER) -> int | None:
    """Items at which an interval of the drop's level would exclude the tolerance with probability `power`, if the
    measured drop held: the half-width falls as 1 / sqrt(items), and the estimate itself scatters by the half-width
    over its z, so the distance must hold z_level + z_power of that scatter, not z_level alone (50 % power)."""
    distance = abs(drop.drop * 100 - tolerance) / 100
    if distance < 1e-9:
        return None
    z_level = stats.two_sided_z(drop.level)
    half = (drop.high - drop.low) / 2
    return math.ceil(drop.items * (half / distance * (z_level + stats.normal_quantile(power)) / z_level) ** 2)


def items_to_resolve(drop: stats.Drop, tolerance: float) -> str:
    needed = items_for_power(drop, tolerance)
    if needed is None:
        return "no number of items would: the measured drop is at the tolerance"
    return f"about {needed:,} items would resolve it with {POWER:.0%} power, if the measured drop held"


def compressed(*frames: pd.DataFrame) -> dict[str, bool]:
    """Per runner in these systems rows, whether it ran with its cache compressed (`compress_cache`: FlexGen's 4-bit
    codes), so that its accuracy is read from rows run the same way."""
    out = {}
    for df in frames:
        if "compress_cache" in df:
            out.update(df.groupby("policy")["compress_cache"].agg(lambda c: bool(c.fillna(False).astype(bool).any())))
    return out


def evidence_for(accuracy: pd.DataFrame, *systems: pd.DataFrame, gate: float = GATE, page: stats.PageFamily | None = None
                 ) -> dict[str, list[AccuracyEvidence]]:
    """accuracy_evidence for the runners of these systems rows, each read as it ran there: at its budget (a later
    frame's where several give one) and with its cache compressed or not."""
    budgets = {}
    for df in systems:
        if "budget" in df:
            budgets.update(df.dropna(subset=["budget"]).groupby("policy")["budget"].first().to_dict())
    return accuracy_evidence(accuracy, budgets, gate, compressed(*systems), page)


def accuracy_evidence(accuracy: pd.DataFrame, budgets: dict[str, float | None], gate: float = GATE,
                      compression: dict[str, bool] | None = None, page: stats.PageFamily | None = None
                      ) -> dict[str, list[AccuracyEvidence]]:
    """Per lossy policy, its paired drop on each accuracy-scored task the full cache passes (the validity gate: no
    accuracy statement from a task the model fails), at the policy's budget in the systems experiments or the nearest
    scored budget below it. budgets: the policy's budget there (None: not a budgeted policy). compression: whether
    each ran compressed there (`compressed`); accuracy rows run otherwise are no evidence for it (FlexGen + H2O's
    4-bit drop says nothing of it uncompressed). page: the page whose `accuracy` section these intervals are (each at
    its level for as many intervals as the rows could give, every lossy policy on every task scored at the budget
    read, counted before the gate: what the rows hold, not what they found); none: each at 95 %."""
    if accuracy.empty:
        return {}
    if compression is not None and "compress_cache" in accuracy:
        ran = accuracy["compress_cache"].fillna(False).astype(bool)
        accuracy = accuracy[(accuracy["policy"] == "full")
                            | (ran == accuracy["policy"].map(lambda p: compression.get(p, False)))]
    table = accuracy_table(accuracy)
    table = table[table["metric"] == "accuracy"]
    gated = accuracy_gate(accuracy, gate)
    valid = passing(gated[gated["length"].isna()], "task")
    rows = scored_rows(accuracy)
    item = accuracy_item(rows)
    read = {}  # policy -> (the budget read, how it stands to the policy's own, the tasks scored there)
    for policy, g in table[table["policy"] != "full"].groupby("policy"):
        budget = budgets.get(policy)
        scored = sorted(g["budget"].unique())
        below = [b for b in scored if budget is None or b <= budget + 1e-9]
        used = below[-1] if below else scored[0]
        where = f"budget {used:g}" + ("" if budget is None or abs(used - budget) < 1e-9
                                      else f" (the nearest scored budget {'below' if below else 'above'} {budget:g})")
        read[policy] = used, where, list(g.loc[g["budget"] == used, "task"])
    intervals = sum(len(tasks) for _, _, tasks in read.values())
    level = page.level("accuracy", intervals) if page is not None else 1 - stats.ALPHA
    out = {}
    for policy, (used, where, tasks) in read.items():
        evidence = [AccuracyEvidence(stats.paired_drop(rows[(rows["task"] == task) & (rows["policy"] == "full")],
                                                       rows[(rows["task"] == task) & (rows["policy"] == policy)
                                                            & (rows["budget"] == used)], "correct", item,
                                                       level=level), task, used, where)
                    for task in tasks if task in valid]
        if evidence:
            out[policy] = evidence
    return out


def judge_accuracy(evidence: list[AccuracyEvidence], tolerance: float) -> AccuracyEvidence:
    """The outcome against a tolerance (pp): ruled out where any passing task's interval lies above it, within it
    where every task's lies below, else cannot tell; the evidence returned is the deciding task's."""
    for e in evidence:
        e.outcome = (RULED_OUT if e.drop.low * 100 > tolerance else WITHIN if e.drop.high * 100 < tolerance
                     else CANNOT_TELL)
    for outcome in (RULED_OUT, CANNOT_TELL):
        hits = [e for e in evidence if e.outcome == outcome]
        if hits:
            return max(hits, key=lambda e: e.drop.high)
    return max(evidence, key=lambda e: e.drop.high)
