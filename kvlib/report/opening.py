"""A chapter's opening: its lead (each chapter module's `lead`, declared by its experiment: kvlib.study.experiment), the
sentence naming the model(s) and machine its rows come from, and its page's error rate."""

from __future__ import annotations

import pandas as pd

from kvlib.report.provenance import sentence

NOTHING = "Nothing was measured for this chapter in this profile."


def opening(lead: str, df: pd.DataFrame, error_rate: str) -> str:
    """A chapter's opening sentences, as Markdown: its lead (one of the functions above, each experiment's declared
    `lead`: kvlib.study.experiment), the sentence naming the model(s) and machine its rows come from
    (kvlib.report.provenance, as its figures' titles do), then its page's error rate (kvlib.report.pages)."""
    if lead == NOTHING:
        return f"**In short.** {lead}"
    where = sentence(df)
    return f"**In short.** {lead}" + (f" {where}" if where else "") + f"\n\n{error_rate}"
