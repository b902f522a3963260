"""The serving experiment's figures: latency and goodput, and memory and requests running, against the request
rate."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from kvlib.report.figure_style import set_style
from kvlib.report.provenance import suptitle
from kvlib.report.serving.frame import MIB, serving_frame


def _long(d: pd.DataFrame, metrics: dict[str, str]) -> pd.DataFrame:
    """Percentile columns as rows: policy, request_rate, percentile, value."""
    ok = d[~d["oom"]]
    cols = [c for c in metrics if c in ok]
    long = ok.melt(id_vars=["policy", "request_rate"], value_vars=cols, var_name="percentile", value_name="value")
    long["percentile"] = long["percentile"].map(metrics)
    long["value"] = pd.to_numeric(long["value"], errors="coerce")
    return long


def latency_vs_rate(df: pd.DataFrame):
    """p50 and p99 TTFT and TPOT, and goodput, against the request rate, one colour per runner (the median over
    repeats); the SLO limits as dotted lines, the offered rate as goodput's dotted diagonal."""
    set_style()
    d = serving_frame(df)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
    for ax, name, label, slo in ((axes[0], "ttft_s", "TTFT (s)", "slo_ttft_s"), (axes[1], "tpot_s", "TPOT (s)",
                                                                                   "slo_tpot_s")):
        long = _long(d, {f"{name}_p50": "p50", f"{name}_p99": "p99"})
        if not long.empty:
            sns.lineplot(long, x="request_rate", y="value", hue="policy", style="percentile", markers=True,
                         estimator="median", errorbar=None, ax=ax)
        if slo in d and d[slo].notna().any():
            ax.axhline(float(d[slo].dropna().iloc[0]), color="crimson", ls=":", lw=1, label="SLO")
        ax.set(xlabel="request rate (requests/s)", ylabel=label, yscale="log", title=f"{label.split()[0]} vs rate")
        ax.legend(fontsize="x-small")
    ok = d[~d["oom"]]
    if "goodput" in ok and ok["goodput"].notna().any():
        sns.lineplot(ok, x="request_rate", y="goodput", hue="policy", marker="o", estimator="median", errorbar=None,
                     ax=axes[2])
        top = ok["request_rate"].max()
        axes[2].plot([0, top], [0, top], color="grey", ls=":", lw=1, label="offered rate")
        axes[2].legend(fontsize="x-small")
    axes[2].set(xlabel="request rate (requests/s)", ylabel="goodput (requests/s within the SLO)", title="Goodput")
    suptitle(fig, df)
    fig.tight_layout()
    return fig


def pool_mib(df: pd.DataFrame) -> float | None:
    """The KV pool every runner got at the rows' capacity (vLLM's rule, kvlib.memory.paged_kv.serving_pool_bytes), in
    MiB; None without a capacity or booked weights."""
    from kvlib.memory.paged_kv import serving_pool_bytes

    cols = ["device_capacity_gb", "device_weights_peak_bytes", "device_weights_packed_peak_bytes"]
    if df.empty or any(c not in df for c in cols) or df[cols[:2]].isna().any(axis=None):
        return None
    row = df.iloc[0]
    weights = int(row[cols[1]]) + int(0 if pd.isna(row[cols[2]]) else row[cols[2]])
    return serving_pool_bytes(int(row[cols[0]] * 2**30), weights) / MIB


def memory_vs_rate(df: pd.DataFrame):
    """Peak KV memory and the most requests running at once against the request rate, per runner."""
    set_style()
    d = serving_frame(df)
    ok = d[~d["oom"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, col, label in ((axes[0], "kv_peak_mib", "peak KV (MiB)"), (axes[1], "max_running", "max running requests")):
        data = ok.assign(**{col: pd.to_numeric(ok[col], errors="coerce")}) if col in ok else ok.iloc[:0]
        if not data.empty and data[col].notna().any():
            sns.lineplot(data, x="request_rate", y=col, hue="policy", marker="o", estimator="median", errorbar=None,
                         ax=ax)
            pool = pool_mib(ok)
            if col == "kv_peak_mib" and pool is not None:
                ax.axhline(pool, color="crimson", ls=":", lw=1, label="the pool (0.9 x capacity - weights)")
            ax.legend(fontsize="x-small")
        ax.set(xlabel="request rate (requests/s)", ylabel=label, title=label[0].upper() + label[1:] + " vs rate")
    suptitle(fig, df)
    fig.tight_layout()
    return fig
