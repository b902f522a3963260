"""Compress instead of preempt (issue 45): a runner that compresses where paged would preempt, read against paged on
the same trace: its preemptions, goodput and p99 TTFT, whom it compressed, and how far those requests' output tokens
still equal paged's."""

from __future__ import annotations

import pandas as pd

from kvlib.report.serving.frame import rates_shown, serving_frame, shown

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
    d = serving_frame(df)
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
    table = table.rename(columns=COMPRESSION_COLUMNS).astype(object).map(shown)
    table.index = rates_shown(table.index, level=0)
    table.index.names = ["request rate (requests/s)", "policy"]
    return table


def compression_lines(d: pd.DataFrame, reference: str = REFERENCE) -> list[str]:
    """Per runner that compresses instead of preempting and per rate: whom it compressed, against the reference's
    (paged's) preemptions, goodput and p99 TTFT there, and how far the compressed requests' tokens, and the others',
    agree with the reference's; the numbers as measured, with how many replays they rest on."""
    if "compressions" not in d:
        return []
    d = serving_frame(d)
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
