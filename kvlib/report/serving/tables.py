"""The serving experiment's tables: every point's measurements, the traces replayed, and each runner's sustained
rate."""

from __future__ import annotations

import pandas as pd

from kvlib.report.serving.frame import rates_shown, serving_frame, shown
from kvlib.report.serving.sustained import ATTAINMENT, sustained_rates

TABLE_COLUMNS = {  # result column -> the table's header
    "ttft_s_p50": "TTFT p50 (s)", "ttft_s_p99": "TTFT p99 (s)", "tpot_s_p50": "TPOT p50 (s)",
    "tpot_s_p99": "TPOT p99 (s)", "request_throughput": "requests/s", "output_throughput": "output tokens/s",
    "goodput": "goodput (requests/s)", "slo_attainment": "within SLO", "max_running": "max running",
    "preemptions": "preemptions", "kv_peak_mib": "peak KV (MiB)",
}


def serving_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per runner and request rate: the latencies, rates, SLO attainment, memory and batch the serving run
    measured (the median of the repeats); a point that ran out of memory reads "OOM"."""
    d = serving_frame(df)
    cols = [c for c in TABLE_COLUMNS if c in d]
    done = d[~d["oom"]]
    table = done.groupby(["policy", "request_rate"])[cols].median(numeric_only=True)
    failed = d[d["oom"]].groupby(["policy", "request_rate"]).size().index
    table = table.reindex(table.index.union(failed)).astype(object)
    for key in failed:
        if key not in done.groupby(["policy", "request_rate"]).groups:
            table.loc[key, :] = "OOM"
    table = table.rename(columns=TABLE_COLUMNS).map(shown)
    table.index = rates_shown(table.index, level=1)
    table.index.names = ["policy", "rate (req/s)"]
    return table


# serving_table cut in three for a page: what the requests saw, what the runner served, what it held
VIEWS = {"Latency and the SLO": ["TTFT p50 (s)", "TTFT p99 (s)", "TPOT p50 (s)", "TPOT p99 (s)", "within SLO"],
         "Throughput": ["requests/s", "output tokens/s", "goodput (requests/s)"],
         "Batch and memory": ["max running", "preemptions", "peak KV (MiB)"]}


def serving_views(df: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """serving_table as three narrower tables (VIEWS), each with the columns the rows hold."""
    table = serving_table(df)
    return {title: table[[c for c in columns if c in table]] for title, columns in VIEWS.items()}


def trace_table(df: pd.DataFrame) -> pd.DataFrame:
    """What each rate's trace held, and whether every runner replayed the same one (one trace digest a rate): a
    column per rate, so that the table stays narrow however many rates the grid has."""
    cols = {"num_requests": "requests", "prompt_tokens_total": "prompt tokens", "output_tokens_total": "output tokens",
            "trace_span_s": "last arrival (s)"}
    g = df.groupby("request_rate")
    table = g[list(cols)].first().rename(columns=cols)
    table["last arrival (s)"] = table["last arrival (s)"].map(lambda x: f"{x:.1f}")
    if "rate_multiple" in df:  # the rate as asked: a multiple of this machine's service rate
        table.insert(0, "x service rate", g["rate_multiple"].first())
    table["runners"] = g["policy"].nunique()
    table["one trace for all"] = g["trace_sha"].nunique() == 1
    table.index = table.index.map(shown)
    table.index.name = "request rate (requests/s)"
    return table.astype(object).T


def sustained_table(df: pd.DataFrame, attainment: float = ATTAINMENT) -> pd.DataFrame:
    """The closing table: per runner, the highest measured rate it sustains under the SLO, p99 TTFT and TPOT there,
    the most requests it ran at once and its preemptions there, and its peak KV."""
    rows = []
    for policy, s in sorted(sustained_rates(df, attainment).items(), key=lambda kv: -(kv[1].rate or 0)):
        r = s.row
        rows.append({"policy": policy, "highest rate sustained": s.text(),
                     "TTFT p99 there (s)": r.get("ttft_s_p99"), "TPOT p99 there (s)": r.get("tpot_s_p99"),
                     "max running there": r.get("max_running"), "preemptions there": r.get("preemptions"),
                     "peak KV there (MiB)": r.get("kv_peak_mib")})
    return pd.DataFrame(rows).set_index("policy").map(shown) if rows else pd.DataFrame()
