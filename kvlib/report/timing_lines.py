"""The sentences of the timing chapters (TTFT, batch scaling, decode length, serving): each reads a results frame,
per kind of machine, and describes ratios of geometric means with the timing rule's interval. None ranks: a ranking
is a claim of the findings' declared family (kvlib.report.verdicts)."""

from __future__ import annotations

import pandas as pd

from kvlib.report import paper, stats
from kvlib.report.tables import (
    decode_kernels,
    decode_spread,
    kernel_note,
    machine_kind,
    outside_label,
    same_kernel,
    ttft_spread,
)


def describe(name_a: str, a, name_b: str, b, what: str) -> str:
    """A's repeats against B's (a, b: their values) as a ratio of geometric means with the timing rule's interval,
    described, never ranked nor called alike: the page's one tested statement is its lead (kvlib.report.pages.TIMING),
    and a claim of equivalence would be a second. Where the interval holds 1, the two are "not distinguishable at n
    repeats", which spends no error rate."""
    c = stats.compare_timings(a, b)
    head = f"{name_a} / {name_b} {what}: {c.ratio:.2f}x"
    if not c.judged:
        return f"{head} (too few repeats for an interval: {c.n_a} and {c.n_b})"
    words = f"{head} (interval {c.low:.2f}-{c.high:.2f}x"
    if c.verdict == stats.NOT_DISTINGUISHABLE:
        words += f"; not distinguishable at {min(c.n_a, c.n_b)} repeats"
    return words + ")"


def repeats_of(df: pd.DataFrame) -> int | None:
    """The repeats a side the page's timings have (the fewest of any point), for the rule's real error rate."""
    keys = [c for c in ("policy", "prefill", "prompt_tokens", "batch_size", "output_tokens") if c in df]
    done = df[~df["oom"].astype(bool)] if "oom" in df else df
    return int(done.groupby(keys).size().min()) if keys and not done.empty else None


def timing_rule_line(df: pd.DataFrame) -> str:
    """How the page's timings are read, said once: the rule with its real size and coverage at the page's repeats."""
    rule = stats.timing_rule(repeats=repeats_of(df), paired="repeat" in df)
    return (f"How timings are read: {rule}; every ratio on this page is described "
            f"with that interval, none is a tested ranking or likeness (the page's one tested statement is its lead; "
            f"the findings' claims are on the findings page); only rows measured on one kind of machine (CPU model "
            f"and GPU) are compared.")


def per_machine(lines_of, df: pd.DataFrame) -> list[str]:
    """lines_of(df) for each kind of machine the rows were measured on: a timing on one machine says nothing about
    another, so a frame that mixes them is read one kind at a time, and says so."""
    kinds = machine_kind(df)
    if kinds.nunique() <= 1:
        return lines_of(df)
    counts = kinds.value_counts().sort_index()
    out = [f"Ours: these rows were measured on {len(counts)} kinds of machine ("
           + "; ".join(f"{kind}: {n} rows" for kind, n in counts.items())
           + "): timings are compared only between rows of one kind, each kind read on its own below."]
    for kind, g in df.groupby(kinds, sort=True):
        out += [line.replace("Ours: ", f"Ours, on {kind}: ", 1) for line in lines_of(g)]
    return out


def disturbed_note(df: pd.DataFrame) -> list[str]:
    if "disturbed" not in df or not df["disturbed"].fillna(False).any():
        return []
    d = df[df["disturbed"].fillna(False).astype(bool)]
    note = (f"Ours: {len(d)} measurement(s) ran while other processes or the hypervisor (steal time) took more than "
            f"10 % of the CPU, twice in a row ({', '.join(sorted(d['policy'].unique()))}); they are kept and flagged "
            f"`disturbed` in the results.")
    return [note]


def ttft(df: pd.DataFrame) -> list[str]:
    return [f"Paper: {paper.TTFT}"] + per_machine(_ttft, df) + [timing_rule_line(df)] + disturbed_note(df)


def _ttft(df: pd.DataFrame) -> list[str]:
    out = []
    for (policy, prefill), g in df.groupby(["policy", "prefill"]):
        done = g.loc[~g["oom"], "prompt_tokens"]
        failed = g.loc[g["oom"], "prompt_tokens"]
        reach = f"completed up to {done.max():,} tokens" if not done.empty else "completed no prompt length"
        wall = f", out of device memory from {failed.min():,} tokens" if not failed.empty else ", no OOM in the grid"
        out.append(f"Ours: {policy} with {prefill} prefill {reach}{wall}.")
    ok = df[~df["oom"]]
    if not ok.empty:
        longest = ok["prompt_tokens"].max()
        runs = dict(list(ok[ok["prompt_tokens"] == longest].groupby(["policy", "prefill"])))
        at = {key: ttft_spread(g) for key, g in runs.items()}
        ranked = sorted(at, key=lambda k: at[k].centre)
        (policy, prefill), best = ranked[0], at[ranked[0]]
        out.append(f"Ours: at {longest:,} tokens the lowest TTFT by geometric mean is {policy}/{prefill}, {best:.2f} s "
                   f"(and the range of {len(runs[ranked[0]])} runs).")
        if len(ranked) > 1:
            (p2, m2) = ranked[1]
            out.append(f"Ours: at {longest:,} tokens, " + describe(f"{policy}/{prefill}",
                                                                  stats.by_round(runs[ranked[0]], "ttft_s"),
                                                                  f"{p2}/{m2}", stats.by_round(runs[ranked[1]], "ttft_s"),
                                                                  "TTFT") + ".")
        out += _ttft_vs_outside(ok, outside_label(df))
    return out


def _ttft_vs_outside(ok: pd.DataFrame, outside: str | None) -> list[str]:
    """The paper's vLLM has the lowest TTFT: the outside engine's rows (ours: the real vLLM) against the kvlib policy
    with the lowest TTFT, at the longest prompt both ran."""
    if outside is None:
        return []
    lengths = set(ok.loc[ok["policy"] == outside, "prompt_tokens"]) & set(ok.loc[ok["policy"] != outside, "prompt_tokens"])
    if not lengths:
        return []
    runs = dict(list(ok[ok["prompt_tokens"] == max(lengths)].groupby(["policy", "prefill"])))
    at = {key: ttft_spread(g) for key, g in runs.items()}
    theirs_key = min((k for k in at if k[0] == outside), key=lambda k: at[k].centre)
    ours = {k: v for k, v in at.items() if k[0] != outside}
    (policy, prefill) = min(ours, key=lambda k: ours[k].centre)
    return [(f"Ours: at {max(lengths):,} tokens {outside} takes {at[theirs_key]:.2f} s to the first token, the kvlib "
             f"policy with the lowest, {policy}/{prefill}, {ours[(policy, prefill)]:.2f} s; "
             + describe(f"{policy}/{prefill}", stats.by_round(runs[(policy, prefill)], "ttft_s"), outside,
                        stats.by_round(runs[theirs_key], "ttft_s"), "TTFT") + ".")]


def _range_words(g: pd.DataFrame) -> str:
    """What a decode throughput's range spans: the per-step quartiles where the rows have them (the engine's own
    timing), else the repeats (throughput measured from outside: one figure a run)."""
    q1 = g.get("decode_tokens_per_s_q1")
    if q1 is not None and q1.notna().all():
        return "geometric mean of its repeats; range: the interquartile range of its decode steps"
    return f"geometric mean and range of {len(g)} repeats"


def batch_scaling(df: pd.DataFrame) -> list[str]:
    return [f"Paper: {paper.BATCH_SCALING}"] + per_machine(_batch_scaling, df) + [timing_rule_line(df)] \
        + disturbed_note(df)


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


def decode_length(df: pd.DataFrame) -> list[str]:
    return [f"Paper: {paper.DECODE_LENGTH}"] + per_machine(_decode_length, df) + [timing_rule_line(df)] \
        + disturbed_note(df)


def _decode_length(df: pd.DataFrame) -> list[str]:
    out = []
    for policy, g in df[~df["oom"]].groupby("policy"):
        by_length = dict(list(g.groupby("output_tokens")))
        first, last = min(by_length), max(by_length)
        a, b = decode_spread(by_length[first]), decode_spread(by_length[last])
        out.append(f"Ours: {policy}: {a:.1f} tok/s at {first} output tokens, {b:.1f} at {last}; "
                   + describe(f"at {last}", stats.by_round(by_length[last], "decode_tokens_per_s"), f"at {first}",
                              stats.by_round(by_length[first], "decode_tokens_per_s"), "decode throughput") + ".")
    return out


def serving(df: pd.DataFrame) -> list[str]:
    """Beyond the paper (no experiment of its has arrivals): kvlib.report.serving's sentences, per kind of machine."""
    from kvlib.report import serving as serving_report

    return ["Paper: none of its experiments has an arrival process (batch scaling is a closed batch)."] \
        + per_machine(serving_report.lines, df) + disturbed_note(df)
