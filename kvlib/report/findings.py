"""Sentences that read the results: each compares our measured numbers with a finding of the paper.

Every sentence is computed from a results frame; nothing here states a number it did not read.
"""

from __future__ import annotations

import math

import pandas as pd

from kvlib.report.tables import (
    Spread,
    accuracy_table,
    decode_kernels,
    decode_spread,
    kernel_note,
    outside_label,
    ratio,
    retention_table,
    ruler_table,
    same_kernel,
    ttft_spread,
)

TITLES = {"ttft": "Time to first token", "batch_scaling": "Batch scaling", "decode_length": "Decode length",
          "accuracy": "Accuracy across KV budgets", "retention": "Retention of an early fact"}

PAPER = {
    "ttft": "full-matrix prefill (needed by H2O's scores) runs out of memory at ~10K tokens on an 80 GB H100; fused "
            "attention rescues InfiniGen, chunked prefill rescues H2O.",
    "batch_scaling": "vLLM has the highest throughput; H2O matches it with far less device memory (~3x throughput "
                     "per GB); InfiniGen is an order of magnitude slower; InfiniGen's host memory grows with batch.",
    "decode_length": "throughput stays roughly flat with output length for vLLM and H2O; InfiniGen's per-step "
                     "transfers keep it far below.",
    "accuracy": "at budget 0.5 both sparse methods are near the full cache; at 0.1 InfiniGen loses ~6 pp on average "
                "and H2O more (HellaSwag -23 pp, BoolQ -16 pp); at 2-4 % both approach chance.",
    "retention": "the full cache retains the fact 94-96 % of the time, InfiniGen within 1-4 pp of it, H2O 17-27 pp "
                 "lower and worse with longer contexts.",
}


def compare(name_a: str, a: Spread, name_b: str, b: Spread, higher_is_better: bool, what: str) -> str:
    """A verdict only when both were measured more than once and their ranges do not overlap."""
    if min(a.n, b.n) < 2:
        return f"a single measurement of {what} each for {name_a} and {name_b}: no spread to judge a difference by"
    if a.overlaps(b):
        return f"{name_a} and {name_b} are within noise of each other on {what} (their measured ranges overlap)"
    better, worse = (name_a, name_b) if (a.median > b.median) == higher_is_better else (name_b, name_a)
    return f"{better} is faster than {worse} on {what} (their measured ranges do not overlap)"


def disturbed_note(df: pd.DataFrame) -> list[str]:
    if "disturbed" not in df or not df["disturbed"].fillna(False).any():
        return []
    d = df[df["disturbed"].fillna(False).astype(bool)]
    note = (f"Ours: {len(d)} measurement(s) ran while other processes took more than 10 % of the CPU, twice in a "
            f"row ({', '.join(sorted(d['policy'].unique()))}); they are kept and flagged `disturbed` in the results.")
    return [note]


def ttft(df: pd.DataFrame) -> list[str]:
    out = [f"Paper: {PAPER['ttft']}"]
    for (policy, prefill), g in df.groupby(["policy", "prefill"]):
        done = g.loc[~g["oom"], "prompt_tokens"]
        failed = g.loc[g["oom"], "prompt_tokens"]
        reach = f"completed up to {done.max():,} tokens" if not done.empty else "completed no prompt length"
        wall = f", out of device memory from {failed.min():,} tokens" if not failed.empty else ", no OOM in the grid"
        out.append(f"Ours: {policy} with {prefill} prefill {reach}{wall}.")
    ok = df[~df["oom"]]
    if not ok.empty:
        longest = ok["prompt_tokens"].max()
        at = {key: ttft_spread(g) for key, g in ok[ok["prompt_tokens"] == longest].groupby(["policy", "prefill"])}
        ranked = sorted(at, key=lambda k: at[k].median)
        (policy, prefill), best = ranked[0], at[ranked[0]]
        runs = ((ok["prompt_tokens"] == longest) & (ok["policy"] == policy) & (ok["prefill"] == prefill)).sum()
        out.append(f"Ours: at {longest:,} tokens the lowest median TTFT is {policy}/{prefill}, {best:.2f} s "
                   f"(median and range of {runs} runs).")
        if len(ranked) > 1:
            (p2, m2), second = ranked[1], at[ranked[1]]
            out.append(f"Ours: at {longest:,} tokens, " + compare(f"{policy}/{prefill}", best, f"{p2}/{m2}", second,
                                                                 False, "TTFT") + ".")
        out += _ttft_vs_outside(ok, outside_label(df))
    return out + disturbed_note(df)


def _ttft_vs_outside(ok: pd.DataFrame, outside: str | None) -> list[str]:
    """The paper's vLLM has the lowest TTFT: the outside engine's rows (ours: the real vLLM) against the best kvlib
    policy, at the longest prompt both ran."""
    if outside is None:
        return []
    lengths = set(ok.loc[ok["policy"] == outside, "prompt_tokens"]) & set(ok.loc[ok["policy"] != outside, "prompt_tokens"])
    if not lengths:
        return []
    at = {key: ttft_spread(g) for key, g in ok[ok["prompt_tokens"] == max(lengths)].groupby(["policy", "prefill"])}
    theirs = min((v for (p, _), v in at.items() if p == outside), key=lambda v: v.median)
    ours = {k: v for k, v in at.items() if k[0] != outside}
    (policy, prefill) = min(ours, key=lambda k: ours[k].median)
    best = ours[(policy, prefill)]
    return [(f"Ours: at {max(lengths):,} tokens {outside} takes {theirs:.2f} s to the first token; the fastest kvlib "
             f"policy, {policy}/{prefill}, {best:.2f} s ({ratio(best, theirs):.2f}x vLLM's); "
             + compare(f"{policy}/{prefill}", best, outside, theirs, False, "TTFT") + ".")]


def batch_scaling(df: pd.DataFrame) -> list[str]:
    out = [f"Paper: {PAPER['batch_scaling']}"]
    for policy, g in df[df["oom"]].groupby("policy"):
        out.append(f"Ours: {policy} ran out of device memory from batch {g['batch_size'].min()} "
                   f"(at {g['oom_where'].iloc[0]}).")
    d = df[~df["oom"]].copy()
    if d.empty:
        return out + ["Ours: no batch completed."]
    outside = outside_label(df)
    biggest = d["batch_size"].max()
    big = d[d["batch_size"] == biggest]
    tps = {policy: decode_spread(g) for policy, g in big.groupby("policy")}
    device = big.groupby("policy")["device_peak_bytes"].median()
    host = big.groupby("policy")["host_peak_bytes"].median()
    per_gib = {p: Spread(*(x / (device[p] / 2**30) for x in (t.median, t.low, t.high)), t.n) for p, t in tps.items()}
    ranked = sorted(tps, key=lambda p: tps[p].median, reverse=True)
    kernels = decode_kernels(big)
    note = kernel_note(kernels, ranked)
    if note:
        out.append(f"Ours: at batch {biggest}, {note}.")
    out.append(f"Ours: at batch {biggest} the highest median decode throughput is {ranked[0]} "
               f"({tps[ranked[0]]:.1f} tok/s; range: the interquartile range of its decode steps).")
    if len(ranked) > 1 and same_kernel(kernels, ranked[0], ranked[1]):
        out.append(f"Ours: at batch {biggest}, " + compare(ranked[0], tps[ranked[0]], ranked[1], tps[ranked[1]], True,
                                                           "decode throughput") + ".")
    for policy in ranked:
        out.append(f"Ours: {policy} at batch {biggest}: {tps[policy]:.1f} tok/s, device peak "
                   f"{device[policy] / 2**30:.2f} GiB, {per_gib[policy].median:.1f} tok/s per GiB, "
                   f"host peak {host[policy] / 2**30:.2f} GiB.")
    if outside and outside in tps and "paged" in tps:
        out.append(f"Ours: kvlib's paged policy decodes at {ratio(tps['paged'], tps[outside]):.2f}x {outside}'s "
                   f"throughput at batch {biggest} (how far kvlib's engine is from a production one); "
                   + compare("paged", tps["paged"], outside, tps[outside], True, "decode throughput") + ".")
    # against the full cache, and against the real vLLM (the paper's H2O: ~3x vLLM's throughput per GB); each pair once
    references = [r for r in ("full", outside) if r and r in tps]
    for i, reference in enumerate(references):
        for policy in [p for p in ranked if p not in references[:i + 1]]:
            if not same_kernel(kernels, policy, reference):
                out.append(f"Ours: {policy} vs {reference} at batch {biggest}: not compared, they decoded with "
                           f"different attention kernels ({kernels[policy]}, {kernels[reference]}).")
                continue
            speed = ratio(tps[policy], tps[reference])
            out.append(f"Ours: {policy} vs {reference} at batch {biggest}: {speed:.2f}x throughput, "
                       f"{ratio(per_gib[policy], per_gib[reference]):.2f}x throughput per GiB of device memory"
                       + ("; the throughputs are within noise" if tps[policy].overlaps(tps[reference])
                          and min(tps[policy].n, tps[reference].n) > 1 else "") + ".")
    if outside and outside in tps and "device_kv_reserved_peak_bytes" in d:
        pool = big[big["policy"] == outside].iloc[0]
        held = pool["device_kv_reserved_peak_bytes"] + pool["device_kv_peak_bytes"]
        out.append(f"Ours: {outside} preallocates its KV pool ({held / 2**30:.2f} GiB) and used "
                   f"{pool['device_kv_peak_bytes'] / 2**30:.2f} GiB of it at batch {biggest}: its device peak, and so "
                   f"its throughput per GiB, counts the whole pool.")
    return out + disturbed_note(df)


def decode_length(df: pd.DataFrame) -> list[str]:
    out = [f"Paper: {PAPER['decode_length']}"]
    d = df[~df["oom"]]
    for policy, g in d.groupby("policy"):
        by_length = {n: decode_spread(x) for n, x in g.groupby("output_tokens")}
        first, last = min(by_length), max(by_length)
        a, b = by_length[first], by_length[last]
        change = f"{b.median / a.median - 1:+.0%}" + (", within noise" if a.overlaps(b) and min(a.n, b.n) > 1 else "")
        out.append(f"Ours: {policy}: {a:.1f} tok/s at {first} output tokens, {b:.1f} at {last} ({change}).")
    return out + disturbed_note(df)


def accuracy(df: pd.DataFrame) -> list[str]:
    out = [f"Paper: {PAPER['accuracy']}"]
    table = accuracy_table(df)
    for task, t in table.groupby("task"):
        full = t[t["policy"] == "full"]
        if full.empty:
            continue
        base, metric = full.iloc[0], t["metric"].iloc[0]
        unit = (lambda x: f"{x:.1%}") if metric == "accuracy" else (lambda x: f"{x:.2f}")
        out.append(f"Ours: {task} ({t['items'].iloc[0]} items), full cache {metric} {unit(base['score'])} "
                   f"(95 % interval {unit(base['low'])}-{unit(base['high'])}).")
        for budget, b in t[t["policy"] != "full"].groupby("budget"):
            parts = []
            for _, row in b.iterrows():
                delta = (f"{(row['score'] - base['score']) * 100:+.1f} pp" if metric == "accuracy"
                         else f"{row['score'] / base['score'] - 1:+.1%}")
                used = (f", attended {row['kv_share_attended']:.0%} of the KV"
                        if not math.isnan(row["kv_share_attended"]) else "")
                parts.append(f"{row['policy']} {unit(row['score'])} ({delta}{used})")
            out.append(f"Ours: {task} at budget {budget:g}: " + ", ".join(parts) + ".")
            verdict = _who_loses_more(b.set_index("policy"))
            if verdict:
                out.append(f"Ours: {task} at budget {budget:g}: {verdict}.")
    return out + ruler(df)


def ruler(df: pd.DataFrame) -> list[str]:
    """RULER read against the paper's accuracy finding: the mean over subtasks per length, each policy's loss against
    the full cache at each budget, and whether H2O loses more than InfiniGen."""
    table = ruler_table(df)
    if table.empty:
        return []
    out = []
    means = table[table["task"] == "mean"]
    for length, t in means.groupby("length"):
        full = t[t["policy"] == "full"]
        if full.empty:
            continue
        base = full.iloc[0]
        tasks = sorted(table.loc[(table["length"] == length) & (table["task"] != "mean"), "task"].unique())
        out.append(f"Ours: RULER at {length:,} tokens ({', '.join(tasks)}; {base['items']} items), full cache "
                   f"{base['score']:.1%} (95 % interval {base['low']:.1%}-{base['high']:.1%}).")
        for budget, b in t[t["policy"] != "full"].groupby("budget"):
            parts = [f"{row['policy']} {row['score']:.1%} ({(row['score'] - base['score']) * 100:+.1f} pp"
                     + (f", attended {row['kv_share_attended']:.0%} of the KV"
                        if not math.isnan(row["kv_share_attended"]) else "") + ")" for _, row in b.iterrows()]
            out.append(f"Ours: RULER at {length:,} tokens, budget {budget:g}: " + ", ".join(parts) + ".")
            verdict = _who_loses_more(b.set_index("policy").assign(metric="accuracy"))
            if verdict:
                out.append(f"Ours: RULER at {length:,} tokens, budget {budget:g}: {verdict}.")
    return out


def _who_loses_more(scores: pd.DataFrame) -> str | None:
    """Whether H2O loses more than InfiniGen (the paper's comparison): a verdict only when their 95 % intervals do not
    overlap; None if one of them is missing. scores: indexed by policy, with score, low, high and metric."""
    if not {"h2o", "infinigen"} <= set(scores.index):
        return None
    h2o, ig = scores.loc["h2o"], scores.loc["infinigen"]
    if h2o["low"] <= ig["high"] and ig["low"] <= h2o["high"]:
        return "H2O and InfiniGen are within noise of each other (95 % intervals overlap; paper: H2O loses more)"
    higher_is_better = h2o["metric"] == "accuracy"
    h2o_worse = (h2o["score"] < ig["score"]) == higher_is_better
    more = "H2O loses more than InfiniGen" if h2o_worse else "InfiniGen loses more than H2O"
    return f"{more} (95 % intervals do not overlap; paper: H2O loses more)"


def retention(df: pd.DataFrame) -> list[str]:
    out = [f"Paper: {PAPER['retention']}"]
    table = retention_table(df)
    if "full" not in table.index:
        return out + ["Ours: no full-cache run to compare with."]
    base = table.loc["full"]
    out.append(f"Ours: {int(base['items'])} questions per policy; the full cache answers {base['score']:.0%} "
               f"(95 % interval {base['low']:.0%}-{base['high']:.0%}).")
    for policy, row in table.drop("full").iterrows():
        used = f", attending {row['kv_share_attended']:.0%} of the KV" if not math.isnan(row["kv_share_attended"]) else ""
        out.append(f"Ours: {policy} answers {row['score']:.0%} ({(row['score'] - base['score']) * 100:+.0f} pp; "
                   f"95 % interval {row['low']:.0%}-{row['high']:.0%}{used}).")
    by_bucket = df.groupby(["bucket", "policy"])["correct"].mean().unstack()
    for bucket, row in by_bucket.iterrows():
        out.append(f"Ours: bucket {bucket}: " + ", ".join(f"{p} {v:.0%}" for p, v in row.items()) + ".")
    verdict = _who_loses_more(table)
    return out + ([f"Ours: retention over all buckets and turns: {verdict}."] if verdict else [])


def markdown(lines: list[str]) -> str:
    """The sentences as a bulleted list, for a notebook's Markdown display."""
    return "\n".join(f"- {line}" for line in lines)
