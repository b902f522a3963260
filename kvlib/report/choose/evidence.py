"""The accuracy evidence the chooser weighs a lossy policy by: its paired drop against the full cache on each task the
full cache passes (the validity gate), and, against a tolerance, one of three outcomes: within it, ruled out, or
"cannot tell at n items" with about how many items would resolve it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pandas as pd

from kvlib.report import stats
from kvlib.report.accuracy.tables import accuracy_table
from kvlib.report.gate import GATE, accuracy_gate, passing
from kvlib.report.measures import accuracy_item, scored_rows
from kvlib.settings import ONE_PASS

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
    lost: float = math.nan  # the share of items the full cache answered and the policy did not
    gained: float = math.nan  # the share the policy answered and the full cache did not

    def text(self, tolerance: float | None = None) -> str:
        d = self.drop
        measured = (f"measured drop {d.drop * 100:.1f} pp on {self.task} at {self.where}, {d.level:.1%} interval "
                    f"{d.low * 100:.1f} to {d.high * 100:.1f} pp over {d.items} items")
        if self.outcome == RULED_OUT:
            return f"loses more than the {tolerance:g} pp allowed ({measured}: its lower end is above it)"
        if self.outcome == CANNOT_TELL:
            return (f"cannot tell at {d.items} items whether it stays within {tolerance:g} pp: the {d.level:.1%} interval spans "
                    f"{d.low * 100:.1f} to {d.high * 100:.1f} pp (measured drop {d.drop * 100:.1f} pp on {self.task} at "
                    f"{self.where}); {items_to_resolve(d, tolerance, self.lost, self.gained)}")
        return measured


POWER = 0.8  # the chance the suggested size settles it, if the measured drop is the true one
# the largest size the advice works out: ten times lm-eval's largest task here (HellaSwag, 10,042 items); a drop that
# close to the tolerance is said to need more, not searched for (each size's chance takes longer the larger it is)
MOST_ITEMS = 100_000


def items_for_power(drop: stats.Drop, tolerance: float, lost: float, gained: float, power: float = POWER
                    ) -> int | None:
    """Items at which an interval of the drop's level would exclude the tolerance with probability `power`, if the
    measured shares of items lost (the full cache right, the policy wrong) and gained held. The measured half-width
    is no guide: at the book's sizes it is mostly the floor (kvlib.report.stats.resolution, z^2 / (n + z^2)), which
    falls as 1 / n, not 1 / sqrt(n). So the chance is worked out at each size over the counts of items lost and
    gained that size could give (`settled_share`), and the smallest size found that reaches `power` is returned;
    None where no size up to MOST_ITEMS does (a drop at the tolerance: none ever would)."""
    if _at_tolerance(drop, tolerance):
        return None
    return _items_for_power(lost, gained, tolerance, drop.level, power)


def _at_tolerance(drop: stats.Drop, tolerance: float) -> bool:
    return abs(drop.drop * 100 - tolerance) < 1e-9


@lru_cache(maxsize=1024)  # the regimes table asks the same of each policy at every workload
def _items_for_power(lost: float, gained: float, tolerance: float, level: float, power: float) -> int | None:
    return stats.smallest_passing(lambda n: settled_share(n, lost, gained, tolerance, level) >= power, MOST_ITEMS)


def settled_share(items: int, lost: float, gained: float, tolerance: float, level: float) -> float:
    """The chance that an interval at `level` on `items` paired items excludes the tolerance (pp) on the side of the
    drop lost - gained, each item lost with chance `lost` and gained with chance `gained`. For each count of items
    lost (b) and gained (c), the interval as stats.paired_drop draws it: the bootstrap's ends z * sd / sqrt(n) from
    the drop, on the grid of 1 / n that a mean of n items can take (rounded outwards), widened to the floor; an
    interval above the tolerance also needs the exact sign test of b against c. The bootstrap's ends are read with
    their skew (Cornish-Fisher): a few items lost among many answered alike have a long upper tail."""
    n, t, z = items, tolerance / 100, stats.two_sided_z(level)
    above, floor = lost - gained > t, stats.resolution(items, level)
    q = lost / (1 - gained) if gained < 1 else 0.0  # an item's chance to be lost, given it was not gained
    log_factorial = np.r_[0.0, np.cumsum(np.log(np.arange(1, n + 1)))]
    c = _bulk(n, gained)[:, None]
    b = np.arange(max(0, _bulk(n - int(c.max()), q)[0]), _bulk(n, q)[-1] + 1)[None, :]
    chance = np.exp(_log_binomial(log_factorial, n, c, gained) + _log_binomial(log_factorial, n - c, b, q))
    lo, hi = b / n, c / n
    d = lo - hi
    var = np.maximum(lo + hi - d**2, 0.0)
    third = lo * (1 - d) ** 3 + hi * (-1 - d) ** 3 + (1 - lo - hi) * (-d) ** 3  # an item's third moment
    skew = np.divide(third, var**1.5 * math.sqrt(n), out=np.zeros_like(var), where=var > 0)
    sd = np.sqrt(var / n)
    if above:
        low = np.minimum(np.floor(n * (d + sd * (-z + (z * z - 1) * skew / 6)) + 1e-9) / n, d - floor)
        signs = np.array([_sign_threshold(int(k), 1 - level) for k in c[:, 0]])[:, None]
        settled = (low > t) & (b >= signs)
    else:
        high = np.maximum(np.ceil(n * (d + sd * (z + (z * z - 1) * skew / 6)) - 1e-9) / n, d + floor)
        settled = high < t
    return float(chance[settled].sum())


def _bulk(n: int, p: float, reach: float = 9.0) -> np.ndarray:
    """The counts a Binomial(n, p) takes within `reach` standard deviations of its mean (the rest: below 1e-18)."""
    sd = math.sqrt(n * p * (1 - p))
    return np.arange(max(0, math.floor(n * p - reach * sd - 1)), min(n, math.ceil(n * p + reach * sd + 1)) + 1)


def _log_binomial(log_factorial: np.ndarray, n, k, p: float) -> np.ndarray:
    """log P(Binomial(n, p) = k), elementwise (-inf where k is out of 0..n or has no chance)."""
    n, k = np.broadcast_arrays(n, k)
    ok = (k >= 0) & (k <= n)
    k, n = np.where(ok, k, 0), np.where(ok, n, 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        hits = k * np.log(p) if p > 0 else np.where(k > 0, -np.inf, 0.0)
        misses = (n - k) * np.log1p(-p) if p < 1 else np.where(n > k, -np.inf, 0.0)
    return np.where(ok, log_factorial[n] - log_factorial[k] - log_factorial[n - k] + hits + misses, -np.inf)


@lru_cache(maxsize=4096)
def _sign_threshold(gained: int, alpha: float) -> int:
    """The fewest items lost against `gained` gained at which the exact sign test rejects at alpha (its p-value falls
    as more are lost; lost = gained never rejects)."""
    return gained + stats.smallest_passing(lambda gap: stats.sign_test_p(gained + gap, gained) <= alpha)


def items_to_resolve(drop: stats.Drop, tolerance: float, lost: float, gained: float) -> str:
    if math.isnan(lost) or math.isnan(gained):
        return "the shares of items lost and gained were not read, so no number of items is suggested"
    if _at_tolerance(drop, tolerance):
        return "no number of items would: the measured drop is at the tolerance"
    needed = items_for_power(drop, tolerance, lost, gained)
    if needed is None:
        return (f"more than {MOST_ITEMS:,} items would be needed for {POWER:.0%} power, if the measured shares of "
                f"items lost and gained held: the measured drop is that close to the tolerance")
    return (f"about {needed:,} items would resolve it with {POWER:.0%} power, if the measured shares of items lost "
            f"and gained held")


def lost_and_gained(reference: pd.DataFrame, other: pd.DataFrame, value: str, item: list[str]) -> tuple[float, float]:
    """The shares of items the reference answered and the other did not, and the reverse (for scores in [0, 1]: the
    mean positive and negative parts of the per-item difference reference - other), joined on the item columns as
    stats.paired_drop joins them; no item shared: as if the two sides' answers were independent."""
    ref, oth = reference.dropna(subset=[value]), other.dropna(subset=[value])
    if set(item) <= set(ref) and set(item) <= set(oth):
        joined = ref.drop_duplicates(item)[item + [value]].merge(oth[item + [value]], on=item, suffixes=("_ref", ""))
        if len(joined):
            d = (joined[f"{value}_ref"] - joined[value]).astype(float)
            return float(d.clip(lower=0).mean()), float((-d).clip(lower=0).mean())
    r, o = ref[value].astype(float).mean(), oth[value].astype(float).mean()
    return float(r * (1 - o)), float((1 - r) * o)


def compressed(*frames: pd.DataFrame) -> dict[str, bool]:
    """Per runner in these systems rows, whether it ran with its cache compressed (`compress_cache`: FlexGen's 4-bit
    codes), so that its accuracy is read from rows run the same way."""
    out = {}
    for df in frames:
        if "compress_cache" in df:
            out.update(df.groupby("policy")["compress_cache"].agg(lambda c: bool(c.fillna(False).astype(bool).any())))
    return out


def compressed_apart(accuracy: pd.DataFrame, *systems: pd.DataFrame) -> set[str]:
    """The runners of these systems rows whose accuracy rows all ran with the cache compressed otherwise than the
    systems rows did (FlexGen + H2O's 4-bit accuracy beside its uncompressed timings)."""
    if accuracy.empty or "compress_cache" not in accuracy:
        return set()
    ran = accuracy.assign(c=accuracy["compress_cache"].fillna(False).astype(bool)).groupby("policy")["c"]
    timed = compressed(*systems)
    return {p for p, c in ran if p in timed and p != "full" and (c != timed[p]).all()}


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
    if "protocol" in accuracy:  # a deployed system's evidence: rows scored as one runs, not the harnesses' one pass
        accuracy = accuracy[accuracy["protocol"] != ONE_PASS]
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
        evidence = []
        for task in (t for t in tasks if t in valid):
            full = rows[(rows["task"] == task) & (rows["policy"] == "full")]
            own = rows[(rows["task"] == task) & (rows["policy"] == policy) & (rows["budget"] == used)]
            lost, gained = lost_and_gained(full, own, "correct", item)
            evidence.append(AccuracyEvidence(stats.paired_drop(full, own, "correct", item, level=level), task, used,
                                             where, lost=lost, gained=gained))
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
