"""Figures of the book, drawn from results frames (kvlib.study.load_results), so notebook cells stay one line."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

GB = 2**30
COMPONENTS = ["weights", "activations", "kv", "kv_reserved", "overhead"]


def _style():
    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")


def ttft(df: pd.DataFrame):
    """TTFT vs prompt length, one line per policy and prefill mode; OOM points marked on the top edge."""
    _style()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ok = df[~df["oom"]]
    sns.lineplot(ok, x="prompt_tokens", y="ttft_s", hue="policy", style="prefill", markers=True, dashes=True, ax=ax)
    oom = df[df["oom"]]
    if not oom.empty:
        top = ok["ttft_s"].max() * 1.3 if not ok.empty else 1
        ax.scatter(oom["prompt_tokens"], [top] * len(oom), marker="x", color="crimson", s=80, label="OOM")
        ax.axhline(top, color="crimson", lw=0.5, ls=":")
    ax.set(xscale="log", yscale="log", xlabel="prompt length (tokens)", ylabel="time to first token (s)",
           title="TTFT vs prompt length (x = out of device memory)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    fig.tight_layout()
    return fig


def memory_components(df: pd.DataFrame, by: str, tier: str = "device", title: str = ""):
    """Peak memory by component, stacked, one bar per (policy, `by`) value.

    The weights are the same for every policy and would dwarf the rest: they are left out and named in the title.
    """
    _style()
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
           title=(title or f"{tier.capitalize()} memory by component") + note)
    ax.legend(title="component", fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    plt.setp(ax.get_xticklabels(), rotation=45, ha="right")
    fig.tight_layout()
    return fig


def batch_scaling(df: pd.DataFrame):
    """Decode throughput, throughput per GiB of device memory, device and host peak memory vs batch size."""
    _style()
    d = df[~df["oom"]].copy()
    d["throughput_per_gib"] = d["decode_tokens_per_s"] / (d["device_peak_bytes"] / GB)
    d["device_peak_gib"] = d["device_peak_bytes"] / GB
    d["host_peak_gib"] = d["host_peak_bytes"] / GB
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [("decode_tokens_per_s", "decode throughput (tokens/s)"),
              ("throughput_per_gib", "throughput per GiB of device memory"),
              ("device_peak_gib", "device memory peak (GiB)"), ("host_peak_gib", "host (offload) memory peak (GiB)")]
    for ax, (col, label) in zip(axes.flat, panels):
        sns.lineplot(d, x="batch_size", y=col, hue="policy", marker="o", ax=ax, legend=ax is axes.flat[0])
        ax.set(xlabel="batch size", ylabel=label)
    fig.suptitle("Batch scaling (mixed-length prompts)")
    fig.tight_layout()
    return fig


def wall_split(df: pd.DataFrame, by: str, title: str = ""):
    """Wall time split into prefill / cache operations / decode, stacked, per (policy, `by`)."""
    _style()
    cols = ["split_prefill_s", "split_cache_ops_s", "split_decode_s"]
    data = df[~df["oom"]].groupby(["policy", by])[cols].mean()
    data.columns = ["prefill", "cache operations", "decode"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    data.plot.bar(stacked=True, ax=ax, width=0.8)
    ax.set(xlabel=f"policy, {by.replace('_', ' ')}", ylabel="wall time (s)", title=title or "Wall-time split")
    ax.legend(fontsize="small")
    plt.setp(ax.get_xticklabels(), rotation=45, ha="right")
    fig.tight_layout()
    return fig


def decode_length(df: pd.DataFrame):
    _style()
    fig, ax = plt.subplots(figsize=(7, 4))
    sns.lineplot(df[~df["oom"]], x="output_tokens", y="decode_tokens_per_s", hue="policy", marker="o", ax=ax)
    ax.set(xlabel="output length (tokens)", ylabel="decode throughput (tokens/s)",
           title="Decode throughput vs output length (fixed input)")
    return fig


def accuracy(table: pd.DataFrame):
    """Paper Fig. 7: one panel per task, score vs KV budget per sparse policy, the full cache as a dashed line."""
    _style()
    tasks = sorted(table["task"].unique())
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        t = table[table["task"] == task]
        sparse = t[t["policy"] != "full"]
        sns.lineplot(sparse, x="budget", y="score", hue="policy", marker="o", ax=ax)
        for _, row in t[t["policy"] == "full"].iterrows():
            ax.axhline(row["score"], color="black", ls="--", lw=1, label="full cache")
        ax.set(xscale="log", xlabel="KV budget (fraction of entries kept)", ylabel=t["metric"].iloc[0], title=task)
        ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def recall_by_length(df: pd.DataFrame):
    """Recall accuracy vs context length, one panel per budget (the full cache in each)."""
    _style()
    d = df[df["task"] == "kvlib_recall"].copy()
    full = d[d["policy"] == "full"]
    budgets = sorted(d["budget"].dropna().unique())
    fig, axes = plt.subplots(1, len(budgets), figsize=(4 * len(budgets), 3.6), sharey=True, squeeze=False)
    for ax, budget in zip(axes.flat, budgets):
        panel = pd.concat([full, d[d["budget"] == budget]])
        sns.lineplot(panel, x="length", y="correct", hue="policy", marker="o", errorbar=None, ax=ax,
                     legend=ax is axes.flat[-1])
        ax.set(xscale="log", xlabel="context length (tokens)", ylabel="recall accuracy", title=f"budget {budget:g}")
    fig.tight_layout()
    return fig


def retention(df: pd.DataFrame):
    """Paper Fig. 8: (a) share of correct answers by context bucket, (b) by turn, the band spanning the buckets."""
    _style()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    order = sorted(df["bucket"].unique(), key=lambda label: df.loc[df["bucket"] == label, "context_tokens"].min())
    sns.barplot(df, x="bucket", y="correct", hue="policy", order=order, errorbar=None, ax=a)
    a.set(xlabel="conversation length bucket (tokens)", ylabel="retention accuracy", title="(a) by context length")
    per_bucket = df.groupby(["policy", "bucket", "turn"], as_index=False)["correct"].mean()
    sns.lineplot(per_bucket, x="turn", y="correct", hue="policy", marker="o", errorbar=("pi", 100), ax=b)
    b.set(xlabel="turn at which the question is asked", ylabel="retention accuracy",
          title="(b) by turn (band: range over buckets)")
    fig.tight_layout()
    return fig
