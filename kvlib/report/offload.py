"""The offload experiment's table, figure and sentences (kvlib.study.experiments.offload), pure functions of its
results frame.

A row's placement is read back from its runner's `percent` setting (FlexGen's six numbers; a runner without one keeps
everything on the device). What a decode step reads off the disk is the policy's count of disk->host bytes while
decoding (`stat_disk_to_host_bytes_in_decode`), per generated token; the share the page cache served is the kernel's
count against kvlib's (kvlib.memory.disk). The disk's read rate is the probe's, measured on the same offload folder
by the same reads: read rate / bytes per token is the decode rate the disk alone would allow.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from kvlib.memory.placement import TIERS, Placement
from kvlib.report import stats
from kvlib.report.figure_style import policy_colours, set_style
from kvlib.report.measures import decode_spread, geometric_mean
from kvlib.report.provenance import suptitle

GIB, MIB = 2**30, 2**20


def placement(percent) -> dict:
    """The share of the KV cache on disk and where the decoder layers' weights are, from FlexGen's percentages."""
    if not isinstance(percent, str):  # a runner with no placement: everything on the device
        return {"kv_on_disk": 0.0, "kv_off_device": 0.0, "weights_on": "device", "placement": "all on the device"}
    p = Placement.parse(percent)
    weights = next((tier for tier, share in zip(TIERS, p.weights) if share == 1), "split")
    kv = ", ".join(f"{share:.0%} {tier}" for tier, share in zip(TIERS, p.kv) if share)
    label = f"KV {kv}" + ("" if weights == "device" else f"; weights {weights}")
    return {"kv_on_disk": p.kv[2], "kv_off_device": 1 - p.kv[0], "weights_on": weights, "placement": label}


def frame(df: pd.DataFrame) -> pd.DataFrame:
    """The rows with their placement, and per generated token what decoding read off the disk."""
    if df.empty:
        return df
    where = pd.DataFrame([placement(p) for p in df.get("percent", pd.Series([None] * len(df)))], index=df.index)
    d = pd.concat([df, where], axis=1)
    read = pd.to_numeric(d.get("stat_disk_to_host_bytes_in_decode", pd.Series(float("nan"), index=d.index)), errors="coerce")
    d["disk_bytes_per_token"] = (read / d["decode_tokens"]).where(d["decode_tokens"] > 0)
    if "stat_disk_read_bytes_page_cache" in d:
        asked = pd.to_numeric(d["stat_disk_to_host_bytes"], errors="coerce")
        d["page_cache_share"] = (pd.to_numeric(d["stat_disk_read_bytes_page_cache"], errors="coerce") / asked
                                 ).where(asked > 0)
    return d


def table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per runner and placement: whether it completed, its peak memory per tier, decode throughput
    (geometric mean of the repeats), what a generated token read off the disk, and what the page cache served."""
    d = frame(df).sort_values(["policy", "weights_on", "kv_on_disk"])  # (weights: "device" before "disk")
    out = []
    for (policy, label), g in d.groupby(["policy", "placement"], sort=False):
        oom = bool(g["oom"].astype(bool).any())
        row = {"runner": policy, "placement": label, "completed": "out of device memory" if oom else "yes"}
        for tier in ("device", "host", "disk"):
            row[f"{tier} peak (GiB)"] = g[f"{tier}_peak_bytes"].max() / GIB
        if not oom:
            row["decode (tok/s)"] = decode_spread(g).centre
            row["disk read per token (MiB)"] = g["disk_bytes_per_token"].median() / MIB
            if "page_cache_share" in g:
                row["served by the page cache"] = g["page_cache_share"].median()
        out.append(row)
    return pd.DataFrame(out).set_index(["runner", "placement"]) if out else pd.DataFrame()


def _tiers(row: pd.Series) -> str:
    """What a run held at its peaks, per tier."""
    held = {tier: row.get(f"{tier}_peak_bytes") for tier in ("device", "host", "disk")}
    return ", ".join(f"{(0 if pd.isna(n) else n) / GIB:.2f} GiB on the {tier}" for tier, n in held.items())


def lead(df: pd.DataFrame) -> str:
    """Who completes at the experiment's device capacity (with its memory per tier), and each offloading runner's
    decode throughput from the KV all off the device on the host to all of it on disk, against the rate the disk's
    measured read rate alone allows. Descriptions of measured values; no ranking."""
    if df.empty:
        return "Nothing was measured for this chapter in this profile."
    d = frame(df)
    capacity = d["device_capacity_gb"].dropna().max() if "device_capacity_gb" in d else None
    where = f"In {capacity:g} GiB of device memory" if pd.notna(capacity) else "With no configured device capacity"
    out = []
    failed = sorted(set(d.loc[d["oom"].astype(bool), "policy"]))
    done = d[~d["oom"].astype(bool)]
    if failed:
        out.append(f"{where}, {', '.join(failed)} ran out of memory on this workload.")
    for policy, g in done[done["kv_off_device"] > 0].groupby("policy"):
        first = g.sort_values("kv_on_disk").iloc[0]
        out.append(f"{policy} completed with its KV off the device ({first['placement']}): {_tiers(first)} at "
                   f"their peaks.")
    lines = []
    for policy, g in done[(done["kv_off_device"] > 0) & (done["weights_on"] == "device")].groupby("policy"):
        shares = sorted(g["kv_on_disk"].unique())
        if len(shares) < 2:
            continue
        lo, hi = (g[g["kv_on_disk"] == s] for s in (shares[0], shares[-1]))
        c = stats.compare_timings(stats.by_round(hi, "decode_tokens_per_s"), stats.by_round(lo, "decode_tokens_per_s"))
        interval = f"interval {c.low:.2f}-{c.high:.2f}x" if c.judged else "too few repeats for an interval"
        per_token, rate = hi["disk_bytes_per_token"].median(), hi["disk_read_bytes_per_s"].median()
        allowed = f", of which the disk's read rate alone allows {rate / per_token:.0f} tok/s" if per_token > 0 else ""
        lines.append(f"{policy} {decode_spread(lo).centre:.1f} tok/s with {shares[0]:.0%} of its KV on disk and "
                     f"{decode_spread(hi).centre:.1f} with {shares[-1]:.0%}, {c.ratio:.2f}x ({interval}), reading "
                     f"{per_token / MIB:.2f} MiB off the disk a generated token{allowed}")
    if lines:
        out.append("Decode throughput (geometric means) as the disk takes the KV: " + "; ".join(lines) + ".")
    return " ".join(out)


def figure(df: pd.DataFrame):
    """Left: decode throughput against the share of the KV on disk, one line per offloading runner (weights on the
    device; the weights-on-disk points marked apart), each with the rate its disk reads alone would allow. Right:
    bytes read off the disk per generated token."""
    set_style()
    d = frame(df)
    d = d[~d["oom"].astype(bool) & (d["kv_off_device"] > 0)]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5))
    colours = policy_colours(d["policy"])  # the book's palette, distinct past ten runners
    for (policy, weights), g in d.groupby(["policy", "weights_on"]):
        points = g.groupby("kv_on_disk").agg(tps=("decode_tokens_per_s", geometric_mean),
                                            per_token=("disk_bytes_per_token", "median"),
                                            rate=("disk_read_bytes_per_s", "median")).reset_index()
        style = {"color": colours[policy], "marker": "o" if weights == "device" else "s",
                 "ls": "-" if weights == "device" else "none"}
        name = policy if weights == "device" else f"{policy}, weights on {weights}"
        ax.plot(points["kv_on_disk"] * 100, points["tps"], label=name, **style)
        bx.plot(points["kv_on_disk"] * 100, points["per_token"] / MIB, label=name, **style)
        limit = points[points["per_token"] > 0]
        if weights == "device" and not limit.empty:
            ax.plot(limit["kv_on_disk"] * 100, limit["rate"] / limit["per_token"], color=colours[policy], ls=":",
                    label=f"{policy}: disk read rate / bytes a token")
    ax.set(yscale="log", xlabel="KV on disk (%; the rest on the host)", ylabel="decode throughput (tokens/s)",
           title="Decode throughput (geometric mean)")
    bx.set(xlabel="KV on disk (%; the rest on the host)", ylabel="read off the disk per generated token (MiB)",
           title="Disk reads per generated token")
    bx.legend(*ax.get_legend_handles_labels(), loc="upper left", bbox_to_anchor=(1.02, 1), fontsize="small")
    suptitle(fig, df)
    fig.tight_layout()
    return fig
