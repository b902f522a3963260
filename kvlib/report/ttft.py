"""The TTFT chapter (paper Fig. 1, 2): its lead, its sentences and its figure, each read from the ttft rows."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from kvlib.report import paper, stats
from kvlib.report.figure_style import set_style
from kvlib.report.measures import geometric_mean, outside_label, ttft_spread
from kvlib.report.opening import NOTHING
from kvlib.report.provenance import titled
from kvlib.report.timing import (
    best_and_next,
    describe,
    led,
    oom_line,
    page_lines,
)
from kvlib.report.timing_figures import spread_words


def lead(df: pd.DataFrame) -> str:
    if df.empty:
        return NOTHING
    ok = df[~df["oom"].astype(bool)]
    out = []
    if not ok.empty:
        longest = ok["prompt_tokens"].max()
        runs = {f"{p}/{m}": g for (p, m), g in ok[ok["prompt_tokens"] == longest].groupby(["policy", "prefill"])}
        first, second, c = best_and_next(runs, "ttft_s", higher=False)
        lead = led(first, second, c, "reaches the first token soonest",
                    f"{ttft_spread(runs[first]).centre:.2f} s by geometric mean", "time")
        out.append(f"At {longest:,} prompt tokens, {lead}.")
    out.append(oom_line(df, ["policy", "prefill"], "prompt_tokens", _tokens))
    return " ".join(out)


def _tokens(x) -> str:
    return f"{x:,} tokens"


def lines(df: pd.DataFrame) -> list[str]:
    return page_lines(paper.TTFT, _ttft, df)


def _ttft(df: pd.DataFrame) -> list[str]:
    out = []
    for (policy, prefill), g in df.groupby(["policy", "prefill"]):
        done = g.loc[~g["oom"], "prompt_tokens"]
        failed = g.loc[g["oom"], "prompt_tokens"]
        reach = f"completed up to {done.max():,} tokens" if not done.empty else "completed no prompt length"
        wall = f", out of device memory from {failed.min():,} tokens" if not failed.empty else ", no OOM in the grid"
        out.append(f"Ours: {policy} with {prefill} prefill {reach}{wall}.")
    ok = df[~df["oom"]]
    if not ok.empty:
        longest = ok["prompt_tokens"].max()
        runs = dict(list(ok[ok["prompt_tokens"] == longest].groupby(["policy", "prefill"])))
        at = {key: ttft_spread(g) for key, g in runs.items()}
        ranked = sorted(at, key=lambda k: at[k].centre)
        (policy, prefill), best = ranked[0], at[ranked[0]]
        n = len(runs[ranked[0]])
        out.append(f"Ours: at {longest:,} tokens the lowest TTFT by geometric mean is {policy}/{prefill}, {best:.2f} s "
                   + (f"(and the range of {n} runs)." if n > 1 else "(one run)."))
        if len(ranked) > 1:
            (p2, m2) = ranked[1]
            out.append(f"Ours: at {longest:,} tokens, " + describe(f"{policy}/{prefill}",
                                                                  stats.by_round(runs[ranked[0]], "ttft_s"),
                                                                  f"{p2}/{m2}", stats.by_round(runs[ranked[1]], "ttft_s"),
                                                                  "TTFT") + ".")
        out += _ttft_vs_outside(ok, outside_label(df))
    return out


def _ttft_vs_outside(ok: pd.DataFrame, outside: str | None) -> list[str]:
    """The paper's vLLM has the lowest TTFT: the outside engine's rows (ours: the real vLLM) against the kvlib policy
    with the lowest TTFT, at the longest prompt both ran."""
    if outside is None:
        return []
    lengths = set(ok.loc[ok["policy"] == outside, "prompt_tokens"]) & set(ok.loc[ok["policy"] != outside, "prompt_tokens"])
    if not lengths:
        return []
    runs = dict(list(ok[ok["prompt_tokens"] == max(lengths)].groupby(["policy", "prefill"])))
    at = {key: ttft_spread(g) for key, g in runs.items()}
    theirs_key = min((k for k in at if k[0] == outside), key=lambda k: at[k].centre)
    ours = {k: v for k, v in at.items() if k[0] != outside}
    (policy, prefill) = min(ours, key=lambda k: ours[k].centre)
    return [(f"Ours: at {max(lengths):,} tokens {outside} takes {at[theirs_key]:.2f} s to the first token, the kvlib "
             f"policy with the lowest, {policy}/{prefill}, {ours[(policy, prefill)]:.2f} s; "
             + describe(f"{policy}/{prefill}", stats.by_round(runs[(policy, prefill)], "ttft_s"), outside,
                        stats.by_round(runs[theirs_key], "ttft_s"), "TTFT") + ".")]


def figure(df: pd.DataFrame):
    """TTFT vs prompt length, one line per policy and prefill mode (geometric mean of the repeats, the band their
    range); OOM points marked on the top edge."""
    set_style()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ok = df[~df["oom"]]
    # no prefill mode drawn with an x (seaborn's second marker), which the title keeps for out of memory
    marks = iter("os^Dv<>p")
    sns.lineplot(ok, x="prompt_tokens", y="ttft_s", hue="policy", style="prefill", dashes=True,
                 markers={mode: next(marks) for mode in sorted(ok["prefill"].unique())},
                 estimator=geometric_mean, errorbar=("pi", 100), ax=ax)
    oom = df[df["oom"]]
    if not oom.empty:
        top = ok["ttft_s"].max() * 1.3 if not ok.empty else 1
        ax.scatter(oom["prompt_tokens"], [top] * len(oom), marker="x", color="crimson", s=80, label="OOM")
        ax.axhline(top, color="crimson", lw=0.5, ls=":")
    ax.set(xscale="log", yscale="log", xlabel="prompt length (tokens)", ylabel="time to first token (s)",
           title=titled(f"TTFT vs prompt length (geometric mean, {spread_words(df, steps=False)}; x = out of device "
                        "memory)", df))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    fig.tight_layout()
    return fig
