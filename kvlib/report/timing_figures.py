"""The figures the timing chapters share: memory by component, the wall-time split, throughput against a grid axis."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from kvlib.report.figure_style import GB, policy_colours, set_style
from kvlib.report.measures import decode_spread
from kvlib.report.provenance import titled

COMPONENTS = ["weights", "weights_packed", "activations", "kv", "kv_reserved", "overhead"]


def memory_components(df: pd.DataFrame, by: str, tier: str = "device", title: str = ""):
    """Peak memory by component, stacked, one bar per (policy, `by`) value.

    The weights are the same for every policy and would dwarf the rest: they are left out and named in the title.
    """
    set_style()
    cols = [f"{tier}_{c}_peak_bytes" for c in COMPONENTS if c != "weights" and f"{tier}_{c}_peak_bytes" in df]
    done = df[~df["oom"]]
    data = done.groupby(["policy", by])[cols].max() / GB
    data.columns = [c.removeprefix(f"{tier}_").removesuffix("_peak_bytes") for c in cols]
    data = data.loc[:, (data > 0).any()]
    weights = done.get(f"{tier}_weights_peak_bytes", pd.Series([0])).max() / GB
    fig, ax = plt.subplots(figsize=(9, 4.5))
    data.plot.bar(stacked=True, ax=ax, width=0.8)
    note = f" (weights, {weights:.2f} GiB for every policy, not shown)" if weights else ""
    ax.set(xlabel=f"policy, {by.replace('_', ' ')}", ylabel=f"{tier} memory, GiB (peak per component)",
           title=titled((title or f"{tier.capitalize()} memory by component") + note, df))
    ax.legend(title="component", fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    plt.setp(ax.get_xticklabels(), rotation=45, ha="right")
    fig.tight_layout()
    return fig


def spread_words(df: pd.DataFrame, steps: bool = True) -> str:
    """What a timing figure's bars (`steps`: the repeats' and their decode steps') or band span, named with as many
    repeats as the rows hold: one repeat has no range of repeats to show."""
    n = int(df["repeat"].nunique()) if "repeat" in df and not df.empty else 1
    if steps:
        return f"bars: range of {n} repeats and their steps" if n > 1 else "1 repeat; bars: its steps' quartiles"
    return f"band: range of {n} repeats" if n > 1 else "1 repeat: no band"


def throughput(d: pd.DataFrame, by: str, ax, legend: bool = True) -> None:
    """Decode throughput vs `by`, one line per policy: the geometric mean over repeats, error bars spanning the repeats
    and each repeat's interquartile range of per-step throughput (kvlib.report.measures.decode_spread, as the findings
    read it)."""
    palette = policy_colours(d["policy"])
    for policy, g in d.groupby("policy"):
        spreads = [(x, decode_spread(point)) for x, point in g.groupby(by)]
        xs, centres = [x for x, _ in spreads], [s.centre for _, s in spreads]
        # max(0, .): a single repeat's geometric mean, exp(log(x)), may round a hair past x
        yerr = [[max(0.0, s.centre - s.low) for _, s in spreads], [max(0.0, s.high - s.centre) for _, s in spreads]]
        ax.errorbar(xs, centres, yerr=yerr, marker="o", capsize=3, label=policy, color=palette[policy])
    if legend:  # beside the axes: inside, a legend of every runner covers the lines
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))


def wall_split(df: pd.DataFrame, by: str, title: str = ""):
    """Wall time split into prefill compute / cache operations / decode compute / other, stacked, per (policy, `by`);
    cache operations as book/methods.md defines them (kvlib.engine.run_result.CACHE_OPS)."""
    set_style()
    cols = [c for c in ("split_prefill_s", "split_cache_ops_s", "split_decode_s", "split_other_s") if c in df]
    data = df[~df["oom"]].groupby(["policy", by])[cols].median()
    data.columns = [c.removeprefix("split_").removesuffix("_s").replace("_", " ").replace("cache ops",
                                                                                          "cache operations")
                    for c in cols]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    data.plot.bar(stacked=True, ax=ax, width=0.8)
    ax.set(xlabel=f"policy, {by.replace('_', ' ')}", ylabel="wall time (s)",
           title=titled(title or "Wall-time split", df))
    ax.legend(fontsize="small")
    plt.setp(ax.get_xticklabels(), rotation=45, ha="right")
    fig.tight_layout()
    return fig
