"""How the book words an accuracy drop: the score's move in pp, its interval and its verdict word."""

from __future__ import annotations

import pandas as pd

from kvlib.report import stats


def signed_pp(drop_share: float) -> str:
    """A drop (a share of items) as the score's move in pp: the reader sees the score move, so a drop of 12 pp reads
    -12.0."""
    return f"{-drop_share * 100 + 0.0:+.1f}"  # + 0.0: no "-0.0" for an unchanged score


def change(drop: stats.Drop) -> str:
    """A policy's change from its reference in pp with the interval and the verdict word (signed_pp)."""
    return f"{signed_pp(drop.drop)} pp, interval {signed_pp(drop.high)} to {signed_pp(drop.low)}: {drop.verdict}"


def role(df: pd.DataFrame, policy: str) -> str:
    """" (exploratory)" for a policy the profile ran on fewer items (kvlib.study.profile: `exploratory`)."""
    if "role" not in df:
        return ""
    return " (exploratory)" if (df.loc[df["policy"] == policy, "role"] == "exploratory").any() else ""


def per_protocol(lines_of, df: pd.DataFrame) -> list[str]:
    """lines_of(df) for each protocol the rows ran under (kvlib.evaluation.generation): a score as deployed and a
    strict one are different measurements, never pooled."""
    if "protocol" not in df or df["protocol"].nunique() <= 1:
        return lines_of(df)
    out = []
    for protocol, g in df.groupby("protocol", sort=True):
        out += [line.replace("Ours: ", f"Ours ({protocol} protocol): ", 1) for line in lines_of(g)]
    return out
