"""The serving experiment's sentences for the findings: the SLO and the rule, each runner's sustained rate, whether
compression bought capacity, and compress instead of preempt."""

from __future__ import annotations

import pandas as pd

from kvlib.report.serving.compression import compression_lines
from kvlib.report.serving.frame import serving_frame
from kvlib.report.serving.sustained import ATTAINMENT, Sustained, sustained_rates


def lines(df: pd.DataFrame, attainment: float = ATTAINMENT) -> list[str]:
    """The findings' sentences: the SLO and the rule, each runner's sustained rate, and whether compression bought
    capacity (each lossy policy against `paged`, the same block pool keeping every entry), with the numbers."""
    if df.empty:
        return []
    d = serving_frame(df)
    first = d.iloc[0]
    slo = ", ".join(f"{name} <= {first[col]:g} s" for name, col in (("TTFT", "slo_ttft_s"), ("TPOT", "slo_tpot_s"))
                    if col in d and pd.notna(first[col]))
    capacity = first.get("device_capacity_gb")
    where = f"a device capacity of {capacity:g} GiB" if pd.notna(capacity) else "no configured device capacity"
    out = [f"{int(first['num_requests'])} requests at each rate, at {where}; SLO {slo or 'none given'}; a rate is "
           + f"sustained where at least {attainment:.0%} of the requests meet it (measured rates only)."]
    rates = sustained_rates(d, attainment)
    out += [f"{p}: sustains {s.text()}" + (f"; p99 TTFT {s.row['ttft_s_p99']:.3g} s, p99 TPOT "
                                            f"{s.row['tpot_s_p99']:.3g} s, up to {s.row['max_running']:.0f} "
                                            f"requests running there" if s.row else "") + "."
            for p, s in sorted(rates.items(), key=lambda kv: -(kv[1].rate or 0))]
    out += _capacity_lines(d, rates)
    out += compression_lines(d)
    if d.groupby(["policy", "request_rate"]).size().max() < 2:
        out.append("Each point was measured once: a difference of one grid step between runners is a reading, not "
                   "a tested difference.")
    return out


def _capacity_lines(d: pd.DataFrame, rates: dict[str, Sustained]) -> list[str]:
    """Whether a lossy policy served more requests at once than `paged`, and sustained a higher rate, at the grid's
    highest rate (where queueing and preemption act)."""
    if "paged" not in rates:
        return []
    lossless = set(d.loc[d["lossless"].fillna(False).astype(bool), "policy"]) if "lossless" in d else {"paged"}
    top = d[~d["oom"]].groupby(["policy", "request_rate"]).median(numeric_only=True)
    out = []
    for policy in sorted(set(rates) - lossless):
        common = sorted(set(top.loc[policy].index) & set(top.loc["paged"].index)) if policy in top.index else []
        if not common:
            continue
        hi = common[-1]
        mine, paged = top.loc[(policy, hi)], top.loc[("paged", hi)]
        a, b = rates[policy].rate or 0.0, rates["paged"].rate or 0.0
        verdict = ("a grid rate above paged's" if a > b else "the grid rate paged sustains" if a == b
                   else "a grid rate below paged's")
        out.append(f"{policy} against paged at {hi:.3g} requests/s: peak KV {mine['kv_peak_mib']:.1f} against "
                   f"{paged['kv_peak_mib']:.1f} MiB, up to {mine['max_running']:.0f} against "
                   f"{paged['max_running']:.0f} requests running, {mine['preemptions']:.0f} against "
                   f"{paged['preemptions']:.0f} preemptions, {mine['request_throughput']:.3g} against "
                   f"{paged['request_throughput']:.3g} requests/s served; it sustains {verdict} "
                   f"({rates[policy].text()} against {rates['paged'].text()}).")
    return out
