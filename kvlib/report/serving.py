"""The serving experiment's tables, figures and sentences (kvlib.study.experiments.serving), pure functions of its
results frame.

**The sustained rate.** A runner sustains a request rate where at least `ATTAINMENT` (90 %) of the trace's requests
met every SLO limit there (`slo_attainment`: goodput / request throughput, the median over repeats), the run completed
and did not run out of memory. The highest rate a runner sustains is the highest *measured* rate at which it, and
every lower measured rate, pass: never a rate between or beyond grid points. Where it passes at the grid's highest
rate, the answer is "at least" that rate (its saturation lies beyond the grid); where it fails at the lowest, "below"
it.

**Compress instead of preempt** (issue 45). A runner that compresses a running request's cache where paged would
preempt it (`compress_h2o`, the scheduler's `compress` schedule) is read against `paged` on the same trace: its
preemptions, goodput and p99 TTFT, whom it compressed, and what that cost those requests: the share of their output
tokens equal to paged's, position by position (greedy decoding; a request it did not compress matches paged's at every
position, which the other requests' share checks).
"""

from __future__ import annotations

from dataclasses import dataclass

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

ATTAINMENT = 0.9  # the share of requests within the SLO a sustained rate needs
MIB = 2**20

TABLE_COLUMNS = {  # result column -> the table's header
    "ttft_s_p50": "TTFT p50 (s)", "ttft_s_p99": "TTFT p99 (s)", "tpot_s_p50": "TPOT p50 (s)",
    "tpot_s_p99": "TPOT p99 (s)", "request_throughput": "requests/s", "output_throughput": "output tokens/s",
    "goodput": "goodput (requests/s)", "slo_attainment": "within SLO", "max_running": "max running",
    "preemptions": "preemptions", "kv_peak_mib": "peak KV (MiB)",
}


def _frame(df: pd.DataFrame) -> pd.DataFrame:
    d = df.copy()
    d["oom"] = d["oom"].fillna(False).astype(bool) if "oom" in d else False
    kv = d["device_kv_peak_bytes"] if "device_kv_peak_bytes" in d else pd.Series(float("nan"), index=d.index)
    d["kv_peak_mib"] = pd.to_numeric(kv, errors="coerce") / MIB
    return d


def serving_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per runner and request rate: the latencies, rates, SLO attainment, memory and batch the serving run
    measured (the median of the repeats); a point that ran out of memory reads "OOM"."""
    d = _frame(df)
    cols = [c for c in TABLE_COLUMNS if c in d]
    done = d[~d["oom"]]
    table = done.groupby(["policy", "request_rate"])[cols].median(numeric_only=True)
    failed = d[d["oom"]].groupby(["policy", "request_rate"]).size().index
    table = table.reindex(table.index.union(failed)).astype(object)
    for key in failed:
        if key not in done.groupby(["policy", "request_rate"]).groups:
            table.loc[key, :] = "OOM"
    table = table.rename(columns=TABLE_COLUMNS).map(_shown)
    table.index.names = ["policy", "request rate (requests/s)"]
    return table


def _shown(x) -> str:
    """A table cell as the book shows it: 3 significant digits, blank where nothing was measured."""
    return x if isinstance(x, str) else "" if pd.isna(x) else f"{x:.3g}"


def trace_table(df: pd.DataFrame) -> pd.DataFrame:
    """What each rate's trace held, and whether every runner replayed the same one (one trace digest a rate)."""
    cols = {"num_requests": "requests", "prompt_tokens_total": "prompt tokens", "output_tokens_total": "output tokens",
            "trace_span_s": "last arrival (s)"}
    g = df.groupby("request_rate")
    table = g[list(cols)].first().rename(columns=cols)
    table["last arrival (s)"] = table["last arrival (s)"].map(lambda x: f"{x:.1f}")
    if "rate_multiple" in df:  # the rate as asked: a multiple of this machine's service rate
        table.insert(0, "x service rate", g["rate_multiple"].first())
    table["runners"] = g["policy"].nunique()
    table["one trace for all"] = g["trace_sha"].nunique() == 1
    table.index.name = "request rate (requests/s)"
    return table


@dataclass
class Sustained:
    """The highest measured rate a runner sustains under the SLO, and what it measured there."""

    policy: str
    rate: float | None  # None: it fails at the lowest rate measured
    lowest: float
    highest: float  # the grid's highest rate for this runner
    row: dict  # the medians at `rate` (empty where rate is None)

    @property
    def at_least(self) -> bool:
        """It sustains the grid's highest rate: its limit lies beyond what was measured."""
        return self.rate is not None and self.rate >= self.highest

    def text(self) -> str:
        if self.rate is None:
            return f"below {self.lowest:.3g} requests/s (the lowest rate measured)"
        return f"{'at least ' if self.at_least else ''}{self.rate:.3g} requests/s"


def passes(g: pd.DataFrame, attainment: float = ATTAINMENT) -> bool:
    """One point's repeats: completed, in memory, and the median share within the SLO at least `attainment`."""
    if g.empty or g["oom"].any():
        return False
    if "completed" in g and not g["completed"].fillna(False).astype(bool).all():
        return False
    share = pd.to_numeric(g["slo_attainment"], errors="coerce").median()
    return bool(share >= attainment - 1e-9)  # a share of requests: 9 of 10 is 0.9, however it was rounded


def sustained_rates(df: pd.DataFrame, attainment: float = ATTAINMENT) -> dict[str, Sustained]:
    """Per runner, the highest measured rate it sustains, by the rule in the module's docstring."""
    d = _frame(df)
    out = {}
    for policy, g in d.groupby("policy"):
        rates = sorted(g["request_rate"].unique())
        best = None
        for rate in rates:
            if not passes(g[g["request_rate"] == rate], attainment):
                break
            best = rate
        at = g[(g["request_rate"] == best) & ~g["oom"]] if best is not None else g.iloc[:0]
        row = at.median(numeric_only=True).to_dict() if not at.empty else {}
        out[policy] = Sustained(policy, None if best is None else float(best), float(rates[0]), float(rates[-1]), row)
    return out


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
    return pd.DataFrame(rows).set_index("policy").map(_shown) if rows else pd.DataFrame()


def lines(df: pd.DataFrame, attainment: float = ATTAINMENT) -> list[str]:
    """The findings' sentences: the SLO and the rule, each runner's sustained rate, and whether compression bought
    capacity (each lossy policy against `paged`, the same block pool keeping every entry), with the numbers."""
    if df.empty:
        return []
    d = _frame(df)
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


# ---- compress instead of preempt (issue 45) --------------------------------------------------------------------------

REFERENCE = "paged"  # the lossless kvlib runner whose output tokens every other kvlib runner's are compared with

COMPRESSION_COLUMNS = {  # result column -> the compression table's header (the median of the repeats)
    "goodput": "goodput (requests/s)", "ttft_s_p99": "TTFT p99 (s)", "preemptions": "preemptions",
    "requests_compressed": "requests compressed", "compressions": "compressions",
    "entries_kept_share": "share of entries a compression kept",
}


def token_ids(value) -> list[list[int]] | None:
    """A row's `output_token_ids` as lists of ints (a parquet round trip gives arrays); None where it has none."""
    if value is None or (not hasattr(value, "__len__") and pd.isna(value)):
        return None
    return [[int(t) for t in request] for request in value]


def _flag(value) -> bool:
    return value is not None and not pd.isna(value) and bool(value)


def agreement(mine: list[int], reference: list[int]) -> float:
    """The share of output positions at which two runs of one request chose the same token, position by position,
    over the longer of the two (greedy decoding: a request nothing touched matches paged's at every position)."""
    n = max(len(mine), len(reference))
    return sum(a == b for a, b in zip(mine, reference)) / n if n else 1.0


def request_agreement(df: pd.DataFrame, reference: str = REFERENCE) -> pd.DataFrame:
    """One row per request of every other kvlib run that recorded its output tokens, against `reference`'s run of the
    same trace (the same `trace_sha`; the same repeat where the reference has it, else its first): policy, request_rate,
    repeat, request (its trace index), compressed (by the compress schedule, in that run), agreement (with the
    reference's tokens, position by position). Runs of an outside engine (vLLM: other kernels) are left out."""
    cols = ["policy", "request_rate", "repeat", "request", "compressed", "agreement"]
    if df.empty or "output_token_ids" not in df or "trace_sha" not in df:
        return pd.DataFrame(columns=cols)
    d = df.assign(repeat=df.get("repeat", 0))
    refs = {}
    for _, r in d[d["policy"] == reference].iterrows():
        ids = token_ids(r["output_token_ids"])
        if ids is not None:
            refs.setdefault((r["trace_sha"], r["repeat"]), ids)
            refs.setdefault((r["trace_sha"], None), ids)
    out = []
    for _, r in d[d["policy"] != reference].iterrows():
        mine = token_ids(r["output_token_ids"])
        ref = refs.get((r["trace_sha"], r["repeat"]), refs.get((r["trace_sha"], None)))
        if mine is None or ref is None or _flag(r.get("outside")):
            continue
        listed = r.get("compressed_requests")
        compressed = set() if listed is None or not hasattr(listed, "__len__") else {int(i) for i in listed}
        out += [{"policy": r["policy"], "request_rate": r["request_rate"], "repeat": r["repeat"], "request": i,
                 "compressed": i in compressed, "agreement": agreement(m, f)}
                for i, (m, f) in enumerate(zip(mine, ref))]
    return pd.DataFrame(out, columns=cols)


def compression_table(df: pd.DataFrame, reference: str = REFERENCE) -> pd.DataFrame:
    """Compress instead of preempt against preempting, per request rate and runner: goodput, p99 TTFT, preemptions,
    how many requests the compress schedule compressed (and how often, keeping what share of a request's entries:
    the medians of the repeats), and the share of output tokens equal to `reference`'s (paged's) on the same trace,
    position by position, for the requests compressed and for the others (the mean over requests and repeats; blank
    where there were none, for the reference itself, and for vLLM, whose kernels are not kvlib's)."""
    d = _frame(df)
    done = d[~d["oom"]]
    if done.empty:
        return pd.DataFrame()
    cols = [c for c in COMPRESSION_COLUMNS if c in done]
    numeric = done[["policy", "request_rate"]].join(done[cols].apply(pd.to_numeric, errors="coerce"))
    table = numeric.groupby(["request_rate", "policy"])[cols].median()
    agree = request_agreement(done, reference)
    for flag, header in ((True, f"tokens as {reference}'s: compressed requests"),
                         (False, f"tokens as {reference}'s: the others")):
        table[header] = agree[agree["compressed"] == flag].groupby(["request_rate", "policy"])["agreement"].mean()
    table = table.rename(columns=COMPRESSION_COLUMNS).astype(object).map(_shown)
    table.index.names = ["request rate (requests/s)", "policy"]
    return table


def compression_lines(d: pd.DataFrame, reference: str = REFERENCE) -> list[str]:
    """Per runner that compresses instead of preempting and per rate: whom it compressed, against the reference's
    (paged's) preemptions, goodput and p99 TTFT there, and how far the compressed requests' tokens, and the others',
    agree with the reference's; the numbers as measured, with how many replays they rest on."""
    if "compressions" not in d:
        return []
    d = _frame(d)
    done = d[~d["oom"]]
    compressing = sorted(done.loc[pd.to_numeric(done["compressions"], errors="coerce").notna(), "policy"].unique())
    agree = request_agreement(done, reference)
    out = []
    for policy in compressing:
        for rate, g in done[done["policy"] == policy].groupby("request_rate"):
            med = g[[c for c in COMPRESSION_COLUMNS if c in g]].apply(pd.to_numeric, errors="coerce").median()
            ref = done[(done["policy"] == reference) & (done["request_rate"] == rate)]
            refmed = ref[[c for c in COMPRESSION_COLUMNS if c in ref]].apply(pd.to_numeric, errors="coerce").median()
            replays = len(g)
            text = (f"{policy} at {rate:.3g} requests/s: {med['requests_compressed']:.0f} of "
                    f"{int(g['num_requests'].iloc[0])} requests compressed ({med['compressions']:.0f} compressions"
                    + (f", each keeping {med['entries_kept_share']:.0%} of a request's entries on average"
                       if pd.notna(med["entries_kept_share"]) else "") + f"), {med['preemptions']:.0f} preemptions")
            if not ref.empty:
                text += (f" against {refmed['preemptions']:.0f} of {reference}'s; goodput {med['goodput']:.3g} "
                         f"against {refmed['goodput']:.3g} requests/s, p99 TTFT {med['ttft_s_p99']:.3g} against "
                         f"{refmed['ttft_s_p99']:.3g} s")
            mine = agree[(agree["policy"] == policy) & (agree["request_rate"] == rate)]
            parts = [f"{a['agreement'].mean():.1%} over the {len(a)} {name}"
                     for name, a in (("compressed", mine[mine["compressed"]]),
                                     ("not compressed", mine[~mine["compressed"]])) if len(a)]
            if parts:
                text += f"; output tokens equal to {reference}'s, position by position: " + ", ".join(parts)
            text += (" (one replay: no interval)." if replays == 1 else
                     f" (the medians of {replays} replays; the agreement over every replay's requests).")
            out.append(text)
    return out


# ---- figures ---------------------------------------------------------------------------------------------------------

def _style():
    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")


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
    _style()
    d = _frame(df)
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
    _style()
    d = _frame(df)
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
    fig.tight_layout()
    return fig
