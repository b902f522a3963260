"""Findings 4 and 5 as the paper states them, each a declared list of claims, each claim one paired drop read at the
findings page's level (kvlib.report.pages.FINDINGS): the rules a claim is read by (near_baseline, in_range,
loses_more) and its reach. Finding 4 is read "on average" over the paper's six tasks, each task weighed equally
(kvlib.report.paper_accuracy; its claims with the readings beside them: paper_accuracy_beside.accuracy_claims);
finding 5, here, over the context-length buckets, conversations resampled within their bucket, and its trend from
the shortest bucket to the longest, H2O under FlexGen's budget rule where the rows record one (the official code's).
Before the verdicts, each claim's reach: the units from which it comes out confirmed with 80 % power if the effect
the paper reports held."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pandas as pd

from kvlib.report import stats
from kvlib.report.drop_words import change, signed_pp
from kvlib.report.gate import passing, retention_gate
from kvlib.report.pages import FINDINGS
from kvlib.report.stats import CONFIRMED, INCONCLUSIVE, REFUTED
from kvlib.report.stats.accuracy import POWER, confirm_chance, difference_verdict, units_for_power
from kvlib.report.tables import budgeted, retention_design

MARGIN = stats.EQUIVALENCE_MARGIN
INFINIGEN_ACCURACY_DROP = 0.06  # the paper: at budget 0.1 "InfiniGen loses ~6 pp on average"
H2O_ACCURACY_DROP = (0.23 + 0.16) / 2  # the paper's H2O at 0.1: HellaSwag -23 pp, BoolQ -16 pp (no average given)
H2O_RETENTION_DROP = (0.17, 0.27)  # the paper's H2O: 17-27 pp below the full cache
INFINIGEN_RETENTION_DROP = (0.01, 0.04)  # the paper's InfiniGen: within 1-4 pp of the full cache
NEAR = MARGIN / 2  # "near the full cache" has no figure in the paper: its reach is stated for half the margin
UNTESTED = "untested"  # a declared claim these rows cannot test: it counts as inconclusive
NAMES = {"h2o": "H2O", "infinigen": "InfiniGen"}  # as a refutation's direction names them


@dataclass(frozen=True)
class DropClaim:
    """One of a finding's claims: the paper's words as tested, the drop it reads and its verdict."""

    name: str
    drop: stats.Drop
    verdict: str
    units: str  # what was resampled: items, conversations
    refuted_as: str = ""  # what a refutation says the rows show instead, in the paper's direction

    def line(self) -> str:
        return f"{self.name}: {change(self.drop)} ({self.drop.clusters} {self.units}), {self.verdict}"


@dataclass(frozen=True)
class Claims:
    """A finding's claims with the lines that set them in context (full-cache scores, what the sizes could show), or,
    where the rows cannot answer, the verdict word and why (`unanswered`)."""

    claims: list[DropClaim]
    context: list[str]
    unanswered: tuple[str, str] | None = None
    untested: tuple[str, ...] = ()  # declared claims these rows cannot test, each with why (each reads inconclusive)
    limits: tuple[str, ...] = ()  # what keeps these rows from settling more (a task beyond the model): said with an
    #                               inconclusive verdict

    @property
    def verdicts(self) -> list[str]:
        return [c.verdict for c in self.claims] + [UNTESTED] * len(self.untested)


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


def as_difference(drop: stats.Drop) -> stats.Drop:
    """The drop with its word read as a difference (stats.difference_verdict): what a claim that one side loses more
    reads, so that its line never says "equivalent" beside a loss it confirms."""
    return replace(drop, verdict=difference_verdict(drop.low, drop.high))


def loses_more(drop: stats.Drop) -> str:
    """A claim that the policy loses more than its reference: confirmed by an interval above 0, refuted only by one
    below it (a gain). A real extra loss is never a refutation, however small: a claim of a difference is refuted by
    an interval on the other side."""
    word = difference_verdict(drop.low, drop.high)
    return CONFIRMED if word == stats.LOWER else REFUTED if word == stats.HIGHER else INCONCLUSIVE


def side(drop: stats.Drop, low: float, high: float, who: str) -> str:
    """What a refuted claim of a drop inside [low, high] shows instead: `who` loses more or less than the paper."""
    return f"{who} loses {'more' if drop.drop > high else 'less'} than the paper reports"


def units_needed(level: float, low: float, high: float, *drops: float) -> int | None:
    """The units (a bucket's, where `drops` names two) from which a claim is confirmed with chance POWER if the
    paper's drops held: one drop, the claim reads it inside [low, high]; two (the shortest bucket's, the longest's),
    it reads the second less the first. Each unit loses with the paper's chance and never gains (a conversation's
    questions lost together: the case that needs the most), the interval at `level` and no narrower than its floor
    (stats.resolution), a normal approximation."""
    effect = drops[-1] - drops[0] if len(drops) > 1 else drops[0]
    z = stats.two_sided_z(level)

    def chance(n: int) -> float:
        se = math.sqrt(sum(d * (1 - d) for d in drops) / n) if n else math.inf
        floor = math.hypot(*(stats.resolution(n, level) for _ in drops))
        return confirm_chance(effect, se, max(z * se, floor), low, high) if n else 0.0

    return units_for_power(chance)


def reach(claim: str, effect: str, needed: int | None, here: str, floor: float, level: float, unit: str) -> str:
    """A claim's reach, said before the verdicts: this profile's units and their floor (no interval is narrower,
    whatever the data: stats.resolution), and from how many units the claim comes out confirmed with 80 % power if
    the effect the paper reports held."""
    size = f"about {needed:,} {unit}" if needed else "no number of units"
    return (f"reach of \"{claim}\" at {level:.2%}: {here} here (no interval narrower than +-{floor * 100:.1f} pp), "
            f"{size} to confirm it with {POWER:.0%} power if {effect}")


def _full_score(rows: pd.DataFrame, value: str) -> float:
    return rows.loc[rows["policy"] == "full", value].astype(float).mean()


def bucket_start(label: str) -> int:
    """A retention bucket's first token count from its label ("1K-2K" -> 1024, "512-1K" -> 512)."""
    first = label.split("-")[0]
    return int(first[:-1]) * 1024 if first.endswith("K") else int(first)


def official_rule(d: pd.DataFrame, rule: str = "flexgen") -> pd.DataFrame:
    """H2O's rows under one budget rule where the rows record one ("flexgen", the official code's: heavy = recent =
    int(budget x tokens); "seen", the paper's words); rows without a budget_rule column (older ones) as they are."""
    if "budget_rule" not in d or not d.loc[d["policy"] == "h2o", "budget_rule"].notna().any():
        return d
    return d[(d["policy"] != "h2o") | (d["budget_rule"] == rule)]


def deployed_rows(df: pd.DataFrame, gate: float, rule: str = "flexgen") -> pd.DataFrame:
    """Retention's rows as finding 5 reads them: the buckets the full cache passes, as deployed where both protocols
    ran (the paper's systems answer as deployed), H2O under `rule` where the rows record one, budgeted, `correct` as
    a share."""
    d = df[df["bucket"].isin(passing(retention_gate(df, gate), "bucket"))]
    if "protocol" in d and d["protocol"].nunique() > 1:
        d = d[d["protocol"] == "deployed"]
    d = official_rule(d, rule)
    return budgeted(d).assign(correct=d["correct"].astype(float))


def seen_line(df: pd.DataFrame, gate: float, full: pd.DataFrame, budget: float, level: float) -> list[str]:
    """H2O under the "seen" rule at the verdict's budget, beside finding 5's verdict (never in it)."""
    if "budget_rule" not in df or not (df["budget_rule"] == "seen").any():
        return []
    seen = deployed_rows(df, gate, "seen")
    seen = seen[(seen["policy"] == "h2o") & (seen["budget"] == budget)]
    if seen.empty:
        return []
    item, cluster, stratum = retention_design(seen)
    d = stats.paired_drop(full, seen, "correct", item, cluster, stratum, level=level)
    return [(f"beside, not in the verdict: H2O under the seen rule (the paper's words: budget x tokens kept in all; "
            f"the verdict reads flexgen, the official code's) at budget {budget:g}: {signed_pp(d.drop)} pp, interval "
            f"{signed_pp(d.high)} to {signed_pp(d.low)} ({d.clusters} conversations)")]


def _shared_budgets(d: pd.DataFrame) -> list[float]:
    """The budgets at which both H2O and InfiniGen ran, smallest first."""
    return [b for b in sorted(d["budget"].unique()) if {"h2o", "infinigen"} <= set(d.loc[d["budget"] == b, "policy"])]


def _buckets_line(d: pd.DataFrame, buckets: list[str], budget: float, gate: float) -> str:
    return (f"buckets {', '.join(buckets)} at budget {budget:g}; full cache {_full_score(d, 'correct'):.1%} (the "
            f"paper's 94-96 % is not a tested claim: the validity gate keeps only the buckets where the full cache "
            f"scores at least {gate:.0%}, so its score here is chosen by the gate)")


def retention_claims(df: pd.DataFrame, gate: float, level: float = FINDINGS.level("finding 5")) -> Claims:
    """Finding 5's three claims, as deployed (the paper's systems answer as deployed), over the buckets the full cache
    passes, at the smallest budget both H2O and InfiniGen ran: InfiniGen's drop within +-5 pp, H2O's inside 17-27 pp
    (widened by the margin), and H2O's drop larger in the longest bucket than in the shortest. The paper's "full
    cache 94-96 %" is not tested: the validity gate picks the buckets by that very score."""
    if df.empty:
        return Claims([], [], ("not run in this profile", "the retention experiment has no results"))
    if "full" not in set(df["policy"]):
        return Claims([], [], ("not testable on this machine", "the retention experiment has no full-cache results"))
    d = deployed_rows(df, gate)
    if d.empty:
        return Claims([], [], ("not testable on this machine", (f"no context-length bucket passes the validity gate "
                                                               f"({gate:.0%} with the full cache)")))
    budgets = _shared_budgets(d)
    if not budgets:
        return Claims([], [], (INCONCLUSIVE, "H2O and InfiniGen did not both run on a bucket that passes"))
    item, cluster, stratum = retention_design(d)
    full, at = d[d["policy"] == "full"], d[d["budget"] == budgets[0]]

    def drop(policy):
        return stats.paired_drop(full, at[at["policy"] == policy], "correct", item, cluster, stratum, level=level)

    infinigen, h2o = drop("infinigen"), drop("h2o")
    low, high = H2O_RETENTION_DROP
    claims = [DropClaim(f"infinigen within +-{MARGIN * 100:g} pp of the full cache", infinigen,
                        near_baseline(infinigen), "conversations", side(infinigen, -MARGIN, MARGIN, "InfiniGen")),
              DropClaim(f"h2o {low * 100:g}-{high * 100:g} pp lower (widened by {MARGIN * 100:g})", h2o,
                        in_range(h2o, low, high), "conversations", side(h2o, low - MARGIN, high + MARGIN, "H2O"))]
    buckets = sorted(d["bucket"].unique(), key=bucket_start)
    ig_mid = sum(INFINIGEN_RETENTION_DROP) / 2
    context = [_buckets_line(d, buckets, budgets[0], gate), *seen_line(df, gate, full, budgets[0], level),
               reach(f"InfiniGen within +-{MARGIN * 100:g} pp", f"InfiniGen loses {ig_mid * 100:g} pp (the middle "
                     f"of the paper's {INFINIGEN_RETENTION_DROP[0] * 100:g}-{INFINIGEN_RETENTION_DROP[1] * 100:g} pp)",
                     units_needed(level, -MARGIN, MARGIN, ig_mid), f"{infinigen.clusters:,} conversations",
                     stats.resolution(infinigen.clusters, level), level, "conversations"),
               reach(f"H2O {low * 100:g}-{high * 100:g} pp lower (+-{MARGIN * 100:g})",
                     f"H2O loses {(low + high) / 2 * 100:g} pp (the middle of the paper's range)",
                     units_needed(level, low - MARGIN, high + MARGIN, (low + high) / 2), f"{h2o.clusters:,} conversations",
                     stats.resolution(h2o.clusters, level), level, "conversations")]
    trend = "h2o worse with longer contexts"
    if len(buckets) < 2:
        return Claims(claims, context, untested=(f"{trend} (one bucket passes: no trend to read)",))
    near, far = (at["bucket"] == buckets[0]), (at["bucket"] == buckets[-1])
    cells = [int(at.loc[cell & (at["policy"] == "h2o")].drop_duplicates(
        [c for c in cluster if c in at] or None).shape[0]) for cell in (near, far)]
    context.append(reach("H2O worse with longer contexts", f"H2O loses the paper's {low * 100:g} pp in the shortest "
                         f"bucket and {high * 100:g} pp in the longest", units_needed(level, 0.0, math.inf, low, high),
                         f"{cells[0]:,} and {cells[1]:,} conversations",
                         math.hypot(*(stats.resolution(c, level) for c in cells)), level, "conversations a bucket"))
    if not at.loc[near & (at["policy"] == "h2o"), "correct"].any():
        return Claims(claims, context, untested=((f"{trend} (H2O retains none of the facts in {buckets[0]} already: "
                                                 f"no room to lose more in {buckets[-1]})"),))
    change = as_difference(stats.drop_change((full[full["bucket"] == buckets[0]], at[near & (at["policy"] == "h2o")]),
                                             (full[full["bucket"] == buckets[-1]], at[far & (at["policy"] == "h2o")]),
                                             "correct", item, cluster, level))
    claims.append(DropClaim(f"{trend} (its drop in {buckets[-1]} less its drop in {buckets[0]}, as the score moves)",
                            change, loses_more(change), "conversations",
                            f"H2O loses less in {buckets[-1]} than in {buckets[0]}, not more"))
    return Claims(claims, context)
