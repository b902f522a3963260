"""How findings 4 and 5 are read, each a declared list of claims, each claim one paired drop read at the findings page's
level (kvlib.report.pages.FINDINGS): the rules a claim is read by (near_baseline, in_range, loses_more) and its reach,
the units from which it comes out confirmed with 80 % power if the effect the paper reports held. Finding 4's claims
are the accuracy chapter's (kvlib.report.accuracy.paper_tasks, with the readings beside them: paper_beside), finding
5's the retention chapter's (kvlib.report.retention.claims)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvlib.report import stats
from kvlib.report.drop_words import change
from kvlib.report.stats import CONFIRMED, INCONCLUSIVE, REFUTED
from kvlib.report.stats.accuracy import POWER, confirm_chance, difference_verdict, units_for_power

MARGIN = stats.EQUIVALENCE_MARGIN
INFINIGEN_ACCURACY_DROP = 0.06  # the paper: at budget 0.1 "InfiniGen loses ~6 pp on average"
H2O_ACCURACY_DROP = (0.23 + 0.16) / 2  # the paper's H2O at 0.1: HellaSwag -23 pp, BoolQ -16 pp (no average given)
NEAR = MARGIN / 2  # "near the full cache" has no figure in the paper: its reach is stated for half the margin
UNTESTED = "untested"  # a declared claim these rows cannot test: it counts as inconclusive
# a finding these rows cannot test for want of a full cache that passes its validity gate: the model and the number of
# items decide that, not the machine (whose missing mechanisms "not testable on this machine" names)
NO_VALID_BASELINE = "not testable on these rows (the full cache passes no validity gate)"
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
