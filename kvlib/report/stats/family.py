"""One error rate per page: every tested statement of a page belongs to one declared family, and the chance that any
of them is wrong is at most ALPHA. The page divides ALPHA among its sections in declared weights (a weighted
Bonferroni: the family-wise error is at most the sum of the sections' shares, whatever the dependence between them);
a section divides its share equally among its intervals, or settles its claims by Holm at its share. The weights are
declared before any data is read (a section's weight never depends on what it found), so a chapter that shows one of
another page's sections reads it at the same level and gets the same objects, the same words."""

from __future__ import annotations

from dataclasses import dataclass

from kvlib.report.stats.rule import ALPHA


@dataclass(frozen=True)
class PageFamily:
    """A page's family: its sections and their declared weights (for the findings page, each finding's number of
    claims as declared; for a chapter, its sections equally)."""

    page: str
    weights: tuple[tuple[str, int], ...]
    alpha: float = ALPHA

    @property
    def total(self) -> int:
        return sum(w for _, w in self.weights)

    def share(self, section: str) -> float:
        """The part of ALPHA a section may spend (Holm among its claims at this, or Bonferroni among its intervals)."""
        return self.alpha * dict(self.weights)[section] / self.total

    def level(self, section: str, intervals: int | None = None) -> float:
        """Each of a section's `intervals` intervals at this level, so that together they spend its share (by default
        as many as its declared weight: the findings page weighs each finding by its claims)."""
        count = dict(self.weights)[section] if intervals is None else intervals
        return 1 - self.share(section) / max(count, 1)

    def shares(self) -> str:
        """Each section's share, in words: "finding 2 2.31%; ..."."""
        return "; ".join(f"{name} {self.share(name):.2%}" for name, _ in self.weights)

    def statement(self) -> str:
        """The page's error rate, said once at its top."""
        return (f"**One error rate for this page.** Every tested statement on it (a verdict word: confirmed, refuted, "
                f"lower, higher, equivalent, larger, smaller, shrinks, grows) belongs to one family, and the chance "
                f"that any of them is wrong is at most {self.alpha:.0%}: {self.alpha:.0%} divided among its sections "
                f"({self.shares()}), each section's part divided among its intervals or settled by Holm among its "
                f"claims. Words that say a difference was not shown (inconclusive, not distinguishable, no trend "
                f"shown) cannot be false positives and spend nothing.")

    def borrowed(self, section: str) -> str:
        """The error rate of a page whose tested statements are all one section of this page's family, read at its
        level (the retention chapter prints finding 5's claims): what that section spends, said once at its top."""
        return (f"**One error rate for this page.** Its tested statements are the {self.page} page's {section}: "
                f"{dict(self.weights)[section]} claims, each interval at {self.level(section):.2%}, as that page "
                f"reads them. So the chance that any of them is wrong is at most {self.share(section):.2%}. The other "
                f"figures below are described, without a verdict word.")
