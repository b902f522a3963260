"""The look every figure of the book shares: one theme, one colour per policy, memory in GiB."""

from __future__ import annotations

import seaborn as sns

GB = 2**30


def set_style() -> None:
    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")


def policy_colours(policies) -> dict:
    """One colour per policy, the same in every panel of a figure (colorblind-safe up to its 10 colours, then evenly
    spaced hues: no two runners share one)."""
    names = sorted(set(policies))
    return dict(zip(names, sns.color_palette("colorblind" if len(names) <= 10 else "husl", len(names))))
