"""How the book words an accuracy drop: the score's move in pp, its interval and its verdict word."""

from __future__ import annotations

from kvlib.report import stats


def signed_pp(drop_share: float) -> str:
    """A drop (a share of items) as the score's move in pp: the reader sees the score move, so a drop of 12 pp reads
    -12.0."""
    return f"{-drop_share * 100 + 0.0:+.1f}"  # + 0.0: no "-0.0" for an unchanged score


def change(drop: stats.Drop) -> str:
    """A policy's change from its reference in pp with the interval and the verdict word (signed_pp)."""
    return f"{signed_pp(drop.drop)} pp, interval {signed_pp(drop.high)} to {signed_pp(drop.low)}: {drop.verdict}"
