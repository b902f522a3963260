"""The batch-scaling chapter (paper Fig. 3-5): its lead, its sentences and its figure, read from the batch_scaling
rows."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from kvlib.report import paper, stats
from kvlib.report.figure_style import GB, policy_colours, set_style
from kvlib.report.measures import decode_kernels, decode_spread, geometric_mean, kernel_note, outside_label, same_kernel
from kvlib.report.opening import NOTHING
from kvlib.report.provenance import suptitle
from kvlib.report.timing import (
    best_and_next,
    describe,
    led,
    oom_line,
    page_lines,
)
from kvlib.report.timing_figures import spread_words, throughput


def lead(df: pd.DataFrame) -> str:
    if df.empty:
        return NOTHING
    ok = df[~df["oom"].astype(bool)]
    if ok.empty:
        return oom_line(df, ["policy"], "batch_size", _batch)
    big = ok[ok["batch_size"] == ok["batch_size"].max()]
    runs = dict(list(big.groupby("policy")))
    first, second, c = best_and_next(runs, "decode_tokens_per_s", higher=True)
    per_gib = {p: decode_spread(g).centre / (g["device_peak_bytes"].median() / 2**30) for p, g in runs.items()}
    lead = led(first, second, c, "decodes fastest", f"{decode_spread(runs[first]).centre:.1f} tok/s by geometric mean",
                "throughput")
    per = ", ".join(f"{p} {v:.1f}" for p, v in sorted(per_gib.items()))  # by name: a description, not a ranking
    return (f"At batch {int(big['batch_size'].iloc[0])}, {lead}. Throughput per GiB of device memory (geometric mean "
            f"over the booked peak, tok/s per GiB): {per}. " + oom_line(df, ["policy"], "batch_size", _batch))


def _batch(x) -> str:
    return f"batch {x}"


def lines(df: pd.DataFrame) -> list[str]:
    return page_lines(paper.BATCH_SCALING, _batch_scaling, df)


def _batch_scaling(df: pd.DataFrame) -> list[str]:
    out = []
    for policy, g in df[df["oom"]].groupby("policy"):
        out.append(f"Ours: {policy} ran out of device memory from batch {g['batch_size'].min()} "
                   f"(at {g['oom_where'].iloc[0]}).")
    d = df[~df["oom"]].copy()
    if d.empty:
        return out + ["Ours: no batch completed."]
    outside = outside_label(df)
    biggest = d["batch_size"].max()
    big = d[d["batch_size"] == biggest]
    runs = {policy: stats.by_round(g, "decode_tokens_per_s") for policy, g in big.groupby("policy")}
    tps = {policy: decode_spread(g) for policy, g in big.groupby("policy")}
    device = big.groupby("policy")["device_peak_bytes"].median()
    host = big.groupby("policy")["host_peak_bytes"].median()
    per_gib = {p: t.centre / (device[p] / 2**30) for p, t in tps.items()}
    ranked = sorted(tps, key=lambda p: tps[p].centre, reverse=True)
    kernels = decode_kernels(big)
    note = kernel_note(kernels, ranked)
    if note:
        out.append(f"Ours: at batch {biggest}, {note}.")
    out.append(f"Ours: at batch {biggest} the highest decode throughput by geometric mean is {ranked[0]} "
               f"({tps[ranked[0]]:.1f} tok/s; {_range_words(big[big['policy'] == ranked[0]])}).")
    references = [r for r in ("full", outside) if r and r in tps]
    if len(ranked) > 1 and same_kernel(kernels, ranked[0], ranked[1]) and not set(ranked[:2]) & set(references):
        out.append(f"Ours: at batch {biggest}, " + describe(ranked[0], runs[ranked[0]], ranked[1], runs[ranked[1]],
                                                            "decode throughput") + ".")
    for policy in ranked:
        out.append(f"Ours: {policy} at batch {biggest}: {tps[policy]:.1f} tok/s, device peak "
                   f"{device[policy] / 2**30:.2f} GiB, {per_gib[policy]:.1f} tok/s per GiB, "
                   f"host peak {host[policy] / 2**30:.2f} GiB.")
    if outside and outside in tps and "paged" in tps:
        out.append(f"Ours: kvlib's paged policy against {outside} at batch {biggest} (how far kvlib's engine is from a "
                   f"production one): " + describe("paged", runs["paged"], outside, runs[outside],
                                                  "decode throughput") + ".")
    # against the full cache, and against the real vLLM (the paper's H2O: ~3x vLLM's throughput per GB); each pair once
    for i, reference in enumerate(references):
        for policy in [p for p in ranked if p not in references[:i + 1]]:
            if not same_kernel(kernels, policy, reference):
                out.append(f"Ours: {policy} vs {reference} at batch {biggest}: not compared, they decoded with "
                           f"different attention kernels ({kernels[policy]}, {kernels[reference]}).")
                continue
            out.append(f"Ours: at batch {biggest}, " + describe(policy, runs[policy], reference, runs[reference],
                                                                "decode throughput")
                       + f"; {per_gib[policy] / per_gib[reference]:.2f}x per GiB of device memory.")
    if outside and outside in tps and "device_kv_reserved_peak_bytes" in d:
        pool = big[big["policy"] == outside].iloc[0]
        held = pool["device_kv_reserved_peak_bytes"] + pool["device_kv_peak_bytes"]
        out.append(f"Ours: {outside} preallocates its KV pool ({held / 2**30:.2f} GiB) and used "
                   f"{pool['device_kv_peak_bytes'] / 2**30:.2f} GiB of it at batch {biggest}: its device peak, and so "
                   f"its throughput per GiB, counts the whole pool.")
    return out


def _range_words(g: pd.DataFrame) -> str:
    """What a decode throughput's range spans: the per-step quartiles where the rows have them (the engine's own
    timing), else the repeats (throughput measured from outside: one figure a run)."""
    q1 = g.get("decode_tokens_per_s_q1")
    if q1 is not None and q1.notna().all():
        return "geometric mean of its repeats; range: the interquartile range of its decode steps"
    return f"geometric mean and range of {len(g)} repeats"


def figure(df: pd.DataFrame):
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
    suptitle(fig, df, title=f"Batch scaling (mixed-length prompts; geometric mean of repeats, {spread_words(df)})")
    fig.tight_layout()
    # one legend beside the four panels: inside one, eleven runners covered its lines
    fig.legend(*axes.flat[0].get_legend_handles_labels(), loc="upper left", bbox_to_anchor=(1.0, 0.93),
               fontsize="small")
    return fig
