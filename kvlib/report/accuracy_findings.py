"""Findings 4 and 5 as the paper states them, each a declared list of claims, each claim one paired drop read at the
findings page's level (kvlib.report.pages.FINDINGS) and pooled as the paper pools it: finding 4 "on average", over
every item of the units the full cache passes (the multiple-choice tasks, RULER per length), items resampled within
their unit; finding 5 over the context-length buckets, conversations resampled within their bucket, and its trend
from the shortest bucket to the longest. Before the verdicts, what the sizes could show."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from kvlib.report import stats
from kvlib.report.drop_words import change
from kvlib.report.gate import passing, passing_units, retention_gate
from kvlib.report.pages import FINDINGS
from kvlib.report.stats import CONFIRMED, INCONCLUSIVE, REFUTED
from kvlib.report.tables import accuracy_item, budgeted, retention_design

MARGIN = stats.EQUIVALENCE_MARGIN
INFINIGEN_ACCURACY_DROP = 0.06  # the paper: at budget 0.1 "InfiniGen loses ~6 pp on average"
H2O_RETENTION_DROP = (0.17, 0.27)  # the paper's H2O: 17-27 pp below the full cache


@dataclass(frozen=True)
class DropClaim:
    """One of a finding's claims: the paper's words as tested, the drop it reads and its verdict."""

    name: str
    drop: stats.Drop
    verdict: str
    units: str  # what was resampled: items, conversations

    def line(self) -> str:
        return f"{self.name}: {change(self.drop)} ({self.drop.clusters} {self.units}), {self.verdict}"


@dataclass(frozen=True)
class Claims:
    """A finding's claims with the lines that set them in context (full-cache scores, what the sizes could show), or,
    where the rows cannot answer, the verdict word and why (`unanswered`)."""

    claims: list[DropClaim]
    context: list[str]
    unanswered: tuple[str, str] | None = None
    untested: tuple[str, ...] = ()  # declared claims these rows cannot test (each reads inconclusive)

    @property
    def verdicts(self) -> list[str]:
        return [c.verdict for c in self.claims] + [INCONCLUSIVE] * len(self.untested)


def near_baseline(drop: stats.Drop) -> str:
    """The paper's "near the full cache": confirmed by an equivalence, refuted only by a loss beyond the margin that
    the drop's own rule establishes (its sign test included), so the verdict never outruns its line."""
    if drop.verdict == stats.EQUIVALENT:
        return CONFIRMED
    return REFUTED if drop.verdict == stats.LOWER and drop.low > MARGIN else INCONCLUSIVE


def in_range(drop: stats.Drop, low: float, high: float) -> str:
    """A drop the paper gives as a range, read with the equivalence margin as its tolerance: confirmed where its
    interval lies inside the range widened by the margin, refuted where its interval misses that widened range
    altogether, else inconclusive (one widened range for both words, so that no interval is both)."""
    if math.isnan(drop.low) or math.isnan(drop.high):
        return INCONCLUSIVE
    if low - MARGIN <= drop.low and drop.high <= high + MARGIN:
        return CONFIRMED
    return REFUTED if drop.high < low - MARGIN or drop.low > high + MARGIN else INCONCLUSIVE


def loses_more(drop: stats.Drop) -> str:
    """A claim that the policy loses more than its reference: refuted by a gain or by an equivalence."""
    return (CONFIRMED if drop.verdict == stats.LOWER else
            REFUTED if drop.verdict in (stats.HIGHER, stats.EQUIVALENT) else INCONCLUSIVE)


def smallest_size(level: float, half_width: float) -> int:
    """The fewest units whose floor (stats.resolution) is narrower than +-half_width at `level`."""
    z2 = stats.two_sided_z(level) ** 2
    return math.floor(z2 * (1 / half_width - 1)) + 1


def reach(units: int, level: float, claim: str, half_width_needed: float, unit: str = "units") -> str:
    """What `units` independent units at `level` can show of a claim that needs an interval no wider than
    +-half_width_needed: no interval is narrower than Wilson's bound at zero (stats.resolution), whatever the data."""
    floor = stats.resolution(units, level)
    if floor < half_width_needed:
        return (f"reachable at {units} {unit} and {level:.2%}: no interval narrower than +-{floor * 100:.1f} pp, so "
                f"{claim} can come out confirmed, refuted or inconclusive")
    return (f"reachable at {units} {unit} and {level:.2%}: no interval narrower than +-{floor * 100:.1f} pp, so "
            f"{claim} cannot come out confirmed, only refuted or inconclusive (it could from "
            f"{smallest_size(level, half_width_needed):,} {unit})")


def _pooled(units: dict) -> pd.DataFrame:
    """Every unit's rows as one frame: `score` the unit's value, `stratum` the unit (and RULER's subtask)."""
    return pd.concat([rows.assign(score=rows[value].astype(float),
                                  stratum=label + ("/" + rows[stratum].astype(str) if stratum else ""))
                      for label, (rows, value, stratum) in units.items()], ignore_index=True)


def _full_score(rows: pd.DataFrame, value: str) -> float:
    return rows.loc[rows["policy"] == "full", value].astype(float).mean()


def accuracy_claims(df: pd.DataFrame, gate: float, level: float = FINDINGS.level("finding 4")) -> Claims:
    """Finding 4's four claims over the pooled items: H2O and InfiniGen near the full cache at budget 0.5, InfiniGen's
    drop at 0.1 inside ~6 pp (1-11: the margin either side), H2O losing more than InfiniGen at 0.1."""
    if df.empty:
        return Claims([], [], ("not run in this profile", "the accuracy experiment has no results"))
    units = passing_units(df, gate)
    if not units:
        return Claims([], [], ("not testable on this machine",
                               f"no scored task passes the validity gate ({gate:.0%} with the full cache)"))
    pooled = _pooled(units)
    item = accuracy_item(pooled)

    def rows(policy, budget=None):
        at = pooled[pooled["policy"] == policy]
        return at if budget is None else at[at["budget"] == budget]

    def drop(reference, other):
        return stats.paired_drop(reference, other, "score", item, None, "stratum", level=level)

    claims = []
    for policy in ("h2o", "infinigen"):
        if not rows(policy, 0.5).empty:
            d = drop(rows("full"), rows(policy, 0.5))
            claims.append(DropClaim(f"{policy} at budget 0.5 near the full cache (+-{MARGIN * 100:g} pp)", d,
                                    near_baseline(d), "items"))
    if not rows("infinigen", 0.1).empty:
        d = drop(rows("full"), rows("infinigen", 0.1))
        low, high = INFINIGEN_ACCURACY_DROP - MARGIN, INFINIGEN_ACCURACY_DROP + MARGIN
        claims.append(DropClaim(f"infinigen at budget 0.1 loses ~{INFINIGEN_ACCURACY_DROP * 100:g} pp "
                                f"(inside {low * 100:g}-{high * 100:g} pp)", d,
                                in_range(d, INFINIGEN_ACCURACY_DROP, INFINIGEN_ACCURACY_DROP), "items"))
    if not rows("h2o", 0.1).empty and not rows("infinigen", 0.1).empty:
        d = drop(rows("infinigen", 0.1), rows("h2o", 0.1))
        claims.append(DropClaim("H2O loses more than InfiniGen at budget 0.1 (H2O's change from InfiniGen)", d,
                                loses_more(d), "items"))
    if not claims:
        return Claims([], [], (INCONCLUSIVE, ("H2O and InfiniGen did not run at budgets 0.1 or 0.5 on a task that "
                                             "passes")))
    n = int(rows("full")[item].drop_duplicates().shape[0])
    context = [f"{label}: full cache {_full_score(r, v):.1%}" for label, (r, v, _) in units.items()]
    context += [(f"pooled over {n} items of {', '.join(units)} (each item weighs the same, items resampled within "
                f"their unit)"),
                reach(n, level, f"\"near the full cache\" (+-{MARGIN * 100:g} pp) and ~6 pp (+-{MARGIN * 100:g})",
                      MARGIN, "items")]
    return Claims(claims, context)


def bucket_start(label: str) -> int:
    """A retention bucket's first token count from its label ("1K-2K" -> 1024, "512-1K" -> 512)."""
    first = label.split("-")[0]
    return int(first[:-1]) * 1024 if first.endswith("K") else int(first)


def deployed_rows(df: pd.DataFrame, gate: float) -> pd.DataFrame:
    """Retention's rows as finding 5 reads them: the buckets the full cache passes, as deployed where both protocols
    ran (the paper's systems answer as deployed), budgeted, `correct` as a share."""
    d = df[df["bucket"].isin(passing(retention_gate(df, gate), "bucket"))]
    if "protocol" in d and d["protocol"].nunique() > 1:
        d = d[d["protocol"] == "deployed"]
    return budgeted(d).assign(correct=d["correct"].astype(float))


def retention_claims(df: pd.DataFrame, gate: float, level: float = FINDINGS.level("finding 5")) -> Claims:
    """Finding 5's three claims, as deployed (the paper's systems answer as deployed), over the buckets the full cache
    passes, at the smallest budget both H2O and InfiniGen ran: InfiniGen's drop within +-5 pp, H2O's inside 17-27 pp
    (widened by the margin), and H2O's drop larger in the longest bucket than in the shortest."""
    if df.empty:
        return Claims([], [], ("not run in this profile", "the retention experiment has no results"))
    if "full" not in set(df["policy"]):
        return Claims([], [], ("not testable on this machine", "the retention experiment has no full-cache results"))
    d = deployed_rows(df, gate)
    if d.empty:
        return Claims([], [], ("not testable on this machine", (f"no context-length bucket passes the validity gate "
                                                               f"({gate:.0%} with the full cache)")))
    budgets = [b for b in sorted(d["budget"].unique()) if {"h2o", "infinigen"} <= set(d.loc[d["budget"] == b,
                                                                                          "policy"])]
    if not budgets:
        return Claims([], [], (INCONCLUSIVE, "H2O and InfiniGen did not both run on a bucket that passes"))
    item, cluster, stratum = retention_design(d)
    full, at = d[d["policy"] == "full"], d[d["budget"] == budgets[0]]

    def drop(policy):
        return stats.paired_drop(full, at[at["policy"] == policy], "correct", item, cluster, stratum, level=level)

    infinigen, h2o = drop("infinigen"), drop("h2o")
    low, high = H2O_RETENTION_DROP
    claims = [DropClaim(f"infinigen within +-{MARGIN * 100:g} pp of the full cache", infinigen,
                        near_baseline(infinigen), "conversations"),
              DropClaim(f"h2o {low * 100:g}-{high * 100:g} pp lower (widened by {MARGIN * 100:g})", h2o,
                        in_range(h2o, low, high), "conversations")]
    buckets = sorted(d["bucket"].unique(), key=bucket_start)
    context = [f"buckets {', '.join(buckets)} at budget {budgets[0]:g}; full cache {_full_score(d, 'correct'):.1%}",
               reach(infinigen.clusters, level, f"InfiniGen's +-{MARGIN * 100:g} pp", MARGIN, "conversations"),
               reach(h2o.clusters, level, f"H2O's {low * 100:g}-{high * 100:g} pp (+-{MARGIN * 100:g})",
                     (high - low) / 2 + MARGIN, "conversations")]
    if len(buckets) > 1:
        near, far = (at["bucket"] == buckets[0]), (at["bucket"] == buckets[-1])
        trend = stats.drop_change((full[full["bucket"] == buckets[0]], at[near & (at["policy"] == "h2o")]),
                                  (full[full["bucket"] == buckets[-1]], at[far & (at["policy"] == "h2o")]),
                                  "correct", item, cluster, level)
        claims.append(DropClaim(f"h2o worse with longer contexts (its drop in {buckets[-1]} less its drop in "
                                f"{buckets[0]}, as the score moves)", trend, loses_more(trend), "conversations"))
        return Claims(claims, context)
    return Claims(claims, context, untested=("h2o worse with longer contexts (one bucket passes: no trend to read)",))
