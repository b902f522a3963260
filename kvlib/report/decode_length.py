"""The decode-length chapter (paper Fig. 6): its lead, its sentences and its figure, read from the decode_length
rows."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from kvlib.report import paper, stats
from kvlib.report.figure_style import set_style
from kvlib.report.measures import decode_spread, geometric_mean
from kvlib.report.opening import NOTHING
from kvlib.report.provenance import titled
from kvlib.report.timing import best_and_next, describe, led, page_lines
from kvlib.report.timing_figures import spread_words, throughput


def lead(df: pd.DataFrame) -> str:
    if df.empty:
        return NOTHING
    ok = df[~df["oom"].astype(bool)]
    longest, shortest = ok["output_tokens"].max(), ok["output_tokens"].min()
    runs = dict(list(ok[ok["output_tokens"] == longest].groupby("policy")))
    first, second, c = best_and_next(runs, "decode_tokens_per_s", higher=True)
    changes = []
    for _, g in ok.groupby("policy"):
        a, b = g[g["output_tokens"] == shortest], g[g["output_tokens"] == longest]
        if not a.empty and not b.empty:
            changes.append(geometric_mean(b["decode_tokens_per_s"]) / geometric_mean(a["decode_tokens_per_s"]) - 1)
    span = (f" From {shortest} to {longest} output tokens the runners' throughputs change by {min(changes):+.0%} to "
            f"{max(changes):+.0%} (geometric means)." if changes and longest != shortest else "")
    prompt = f" after a {int(ok['prompt_tokens'].iloc[0]):,}-token prompt" if "prompt_tokens" in ok else ""
    lead = led(first, second, c, "decodes fastest", f"{decode_spread(runs[first]).centre:.1f} tok/s by geometric mean",
                "throughput")
    return f"At {longest} output tokens{prompt}, {lead}.{span}"


def lines(df: pd.DataFrame) -> list[str]:
    return page_lines(paper.DECODE_LENGTH, _decode_length, df)


def _decode_length(df: pd.DataFrame) -> list[str]:
    out = []
    for policy, g in df[~df["oom"]].groupby("policy"):
        by_length = dict(list(g.groupby("output_tokens")))
        first, last = min(by_length), max(by_length)
        a, b = decode_spread(by_length[first]), decode_spread(by_length[last])
        out.append(f"Ours: {policy}: {a:.1f} tok/s at {first} output tokens, {b:.1f} at {last}; "
                   + describe(f"at {last}", stats.by_round(by_length[last], "decode_tokens_per_s"), f"at {first}",
                              stats.by_round(by_length[first], "decode_tokens_per_s"), "decode throughput") + ".")
    return out


def figure(df: pd.DataFrame):
    set_style()
    fig, ax = plt.subplots(figsize=(7, 4))
    throughput(df[~df["oom"]], "output_tokens", ax)
    ax.set(xlabel="output length (tokens)", ylabel="decode throughput (tokens/s)",
           title=titled(f"Decode throughput vs output length (geometric mean, {spread_words(df)})", df))
    return fig
