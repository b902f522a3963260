"""Figures of the book, drawn from results frames (kvlib.study.results.load), so notebook cells stay one line; the
findings' overview figure has its own module (kvlib.report.overview_figure), the paper's Fig. 7 on its six tasks
too (kvlib.report.fig7)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from kvlib.report.figure_style import GB, policy_colours, set_style
from kvlib.report.provenance import suptitle, titled
from kvlib.report.tables import decode_spread, geometric_mean

COMPONENTS = ["weights", "weights_packed", "activations", "kv", "kv_reserved", "overhead"]


def ttft(df: pd.DataFrame):
    """TTFT vs prompt length, one line per policy and prefill mode (geometric mean of the repeats, the band their
    range); OOM points marked on the top edge."""
    set_style()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ok = df[~df["oom"]]
    sns.lineplot(ok, x="prompt_tokens", y="ttft_s", hue="policy", style="prefill", markers=True, dashes=True,
                 estimator=geometric_mean, errorbar=("pi", 100), ax=ax)
    oom = df[df["oom"]]
    if not oom.empty:
        top = ok["ttft_s"].max() * 1.3 if not ok.empty else 1
        ax.scatter(oom["prompt_tokens"], [top] * len(oom), marker="x", color="crimson", s=80, label="OOM")
        ax.axhline(top, color="crimson", lw=0.5, ls=":")
    ax.set(xscale="log", yscale="log", xlabel="prompt length (tokens)", ylabel="time to first token (s)",
           title=titled("TTFT vs prompt length (geometric mean, band: range of repeats; x = out of device memory)", df))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    fig.tight_layout()
    return fig


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


def batch_scaling(df: pd.DataFrame):
    """Decode throughput, throughput per GiB of device memory, device and host peak memory vs batch size."""
    set_style()
    d = df[~df["oom"]].copy()
    d["throughput_per_gib"] = d["decode_tokens_per_s"] / (d["device_peak_bytes"] / GB)
    d["device_peak_gib"] = d["device_peak_bytes"] / GB
    d["host_peak_gib"] = d["host_peak_bytes"] / GB
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [("decode_tokens_per_s", "decode throughput (tokens/s)"),
              ("throughput_per_gib", "throughput per GiB of device memory"),
              ("device_peak_gib", "device memory peak (GiB)"), ("host_peak_gib", "host (offload) memory peak (GiB)")]
    for ax, (col, label) in zip(axes.flat, panels):
        if col == "decode_tokens_per_s":
            throughput(d, "batch_size", ax, legend=False)
        else:
            sns.lineplot(d, x="batch_size", y=col, hue="policy", palette=policy_colours(d["policy"]), marker="o",
                         estimator=geometric_mean, errorbar=None, ax=ax, legend=False)
        ax.set(xlabel="batch size", ylabel=label)
    suptitle(fig, df, title="Batch scaling (mixed-length prompts; geometric mean of repeats, bars: range of repeats "
                            "and their steps)")
    fig.tight_layout()
    # one legend beside the four panels: inside one, eleven runners covered its lines
    fig.legend(*axes.flat[0].get_legend_handles_labels(), loc="upper left", bbox_to_anchor=(1.0, 0.93),
               fontsize="small")
    return fig


def throughput(d: pd.DataFrame, by: str, ax, legend: bool = True) -> None:
    """Decode throughput vs `by`, one line per policy: the geometric mean over repeats, error bars spanning the repeats
    and each repeat's interquartile range of per-step throughput (kvlib.report.tables.decode_spread, as the findings
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


def decode_length(df: pd.DataFrame):
    set_style()
    fig, ax = plt.subplots(figsize=(7, 4))
    throughput(df[~df["oom"]], "output_tokens", ax)
    ax.set(xlabel="output length (tokens)", ylabel="decode throughput (tokens/s)",
           title=titled("Decode throughput vs output length (geometric mean, bars: range of repeats and their steps)",
                        df))
    return fig


def accuracy(table: pd.DataFrame, rows: pd.DataFrame | None = None):
    """Paper Fig. 7: one panel per task, score against the KV share each policy actually attended (its configured
    budget as the point's marker), 95 % intervals as bars, the full cache as a dashed line with its band; the key below
    the panels (eleven policies' names written beside their points covered each other). The model and machine above
    them, from `rows` (the table's rows) where given, else from the table."""
    set_style()
    tasks = sorted(table["task"].unique())
    fig, axes = plt.subplots(1, len(tasks), figsize=(max(9.0, 5.5 * len(tasks)), 6), squeeze=False)
    palette = policy_colours(table["policy"])
    budgets = sorted(table.loc[table["policy"] != "full", "budget"].dropna().unique())
    shapes = {b: "vsD^Po*X"[i % 8] for i, b in enumerate(budgets)}
    for ax, task in zip(axes.flat, tasks):
        t = table[table["task"] == task]
        for policy, g in t[t["policy"] != "full"].groupby("policy"):
            g = g.sort_values("kv_share_attended")
            ax.errorbar(g["kv_share_attended"], g["score"], yerr=[g["score"] - g["low"], g["high"] - g["score"]],
                        capsize=3, color=palette[policy])
            for budget, at in g.groupby("budget"):
                ax.scatter(at["kv_share_attended"], at["score"], marker=shapes[budget], s=40,
                           color=palette[policy], edgecolors="black", linewidths=0.5, zorder=3)
        for _, row in t[t["policy"] == "full"].iterrows():
            ax.axhline(row["score"], color="black", ls="--", lw=1)
            ax.axhspan(row["low"], row["high"], color="black", alpha=0.08)
        ax.set(xscale="log", yscale="log" if t["metric"].iloc[0] == "word perplexity" else "linear",
               xlabel="KV share attended during decode", ylabel=t["metric"].iloc[0], title=task)
    key = [plt.Line2D([], [], color="black", ls="--", label="full cache (band: 95 %)")]
    key += [plt.Line2D([], [], color=palette[p], label=p) for p in sorted(set(table["policy"]) - {"full"})]
    key += [plt.Line2D([], [], ls="", marker=shapes[b], color="grey", mec="black", label=f"configured budget {b:g}")
            for b in budgets]
    columns = 3 if len(tasks) == 1 else 4
    suptitle(fig, table if rows is None else rows)
    fig.legend(handles=key, loc="lower center", ncol=columns, fontsize="small", frameon=False)
    fig.tight_layout(rect=(0, 0.03 + 0.04 * -(-len(key) // columns), 1, 1))
    return fig


def recall_by_length(df: pd.DataFrame):
    """Recall accuracy vs context length, one panel per budget (the full cache in each)."""
    set_style()
    d = df[df["task"] == "kvlib_recall"].copy()
    full = d[d["policy"] == "full"]
    budgets = sorted(d["budget"].dropna().unique())
    fig, axes = plt.subplots(1, len(budgets), figsize=(4 * len(budgets), 3.6), sharey=True, squeeze=False)
    for ax, budget in zip(axes.flat, budgets):
        panel = pd.concat([full, d[d["budget"] == budget]])
        sns.lineplot(panel, x="length", y="correct", hue="policy", palette=policy_colours(d["policy"]), marker="o",
                     errorbar=None, ax=ax,
                     legend=ax is axes.flat[-1])
        ax.set(xscale="log", xlabel="context length (tokens)", ylabel="recall accuracy", title=f"budget {budget:g}")
    suptitle(fig, df)
    fig.tight_layout()
    return fig


def retention(df: pd.DataFrame):
    """Paper Fig. 8: (a) share of correct answers by context bucket, (b) by turn, the band spanning the buckets; one
    row of the two per protocol the rows ran under (two measurements, read apart)."""
    set_style()
    protocols = sorted(df["protocol"].dropna().unique()) if "protocol" in df else []
    fig, axes = plt.subplots(max(1, len(protocols)), 2, figsize=(11, 4 * max(1, len(protocols))), squeeze=False)
    order = sorted(df["bucket"].unique(), key=lambda label: df.loc[df["bucket"] == label, "context_tokens"].min())
    palette = policy_colours(df["policy"])
    for (a, b), protocol in zip(axes, protocols or [None]):
        d = df if protocol is None else df[df["protocol"] == protocol]
        named = f", {protocol}" if len(protocols) > 1 else ""
        sns.barplot(d, x="bucket", y="correct", hue="policy", palette=palette, order=order, errorbar=("ci", 95),
                    seed=0, ax=a, legend=False)
        a.set(xlabel="conversation length bucket (tokens)", ylabel="retention accuracy",
              title=f"(a) by context length{named} (bars: 95 % bootstrap interval)")
        per_bucket = d.groupby(["policy", "bucket", "turn"], as_index=False)["correct"].mean()
        sns.lineplot(per_bucket, x="turn", y="correct", hue="policy", palette=palette, marker="o",
                     errorbar=("pi", 100), ax=b)
        b.set(xlabel="turn at which the question is asked", ylabel="retention accuracy",
              title=f"(b) by turn{named} (band: range over buckets)")
        b.legend(title="policy", fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))  # inside, it hid lines
    suptitle(fig, df)
    fig.tight_layout()
    return fig


def ruler(table: pd.DataFrame, task: str = "mean", rows: pd.DataFrame | None = None):
    """RULER score vs KV budget, one line per policy, one panel per length (kvlib.report.tables.ruler_table; `task`: one
    subtask or `mean`, the mean over the subtasks); bars: 95 % bootstrap interval over the items; the full cache as a
    dashed line with its band. The model and machine in the title, from `rows` where given, else from the table."""
    set_style()
    t = table[table["task"] == task]
    lengths = sorted(t["length"].unique())
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 3.8), sharey=True, squeeze=False)
    palette = policy_colours(table["policy"])
    for ax, length in zip(axes.flat, lengths):
        at = t[t["length"] == length]
        for policy, g in at[at["policy"] != "full"].groupby("policy"):
            g = g.sort_values("budget")
            ax.errorbar(g["budget"], g["score"], yerr=[g["score"] - g["low"], g["high"] - g["score"]], marker="o",
                        capsize=3, label=policy, color=palette[policy])
        for _, row in at[at["policy"] == "full"].iterrows():
            ax.axhline(row["score"], color="black", ls="--", lw=1, label="full cache")
            ax.axhspan(row["low"], row["high"], color="black", alpha=0.08)
        ax.set(xscale="log", ylim=(-0.03, 1.03), xlabel="configured KV budget",
               ylabel=f"RULER score ({task})", title=f"{length:,} tokens")
        ax.legend(fontsize="small")
    suptitle(fig, table if rows is None else rows,
             title=f"RULER {'mean over subtasks' if task == 'mean' else task} vs KV budget (bars: 95 % interval)")
    fig.tight_layout()
    return fig
