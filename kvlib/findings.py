"""Sentences that read the results: each compares our measured numbers with a finding of the paper.

Every sentence is computed from a results frame; nothing here states a number it did not read.
"""

from __future__ import annotations

import math

import pandas as pd

from kvlib.backends.vllm import VLLMBackend

VLLM = VLLMBackend.label  # the rows of the real vLLM, the outside baseline, where a profile runs it

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
        at = ok[ok["prompt_tokens"] == longest].groupby(["policy", "prefill"])["ttft_s"].mean().sort_values()
        (policy, prefill), best = at.index[0], at.iloc[0]
        out.append(f"Ours: at {longest:,} tokens the lowest TTFT is {policy}/{prefill} ({best:.2f} s).")
        out += _ttft_vs_vllm(ok)
    return out


def _ttft_vs_vllm(ok: pd.DataFrame) -> list[str]:
    """The paper's vLLM has the lowest TTFT: ours against the best kvlib policy, at the longest prompt both ran."""
    lengths = set(ok.loc[ok["policy"] == VLLM, "prompt_tokens"]) & set(ok.loc[ok["policy"] != VLLM, "prompt_tokens"])
    if not lengths:
        return []
    at = ok[ok["prompt_tokens"] == max(lengths)].groupby(["policy", "prefill"])["ttft_s"].mean()
    theirs = at[VLLM].min()
    ours = at.drop(VLLM, level="policy").sort_values()
    (policy, prefill), best = ours.index[0], ours.iloc[0]
    return [(f"Ours: at {max(lengths):,} tokens {VLLM} takes {theirs:.2f} s to the first token; the fastest kvlib "
             f"policy, {policy}/{prefill}, {best:.2f} s ({best / theirs:.2f}x vLLM's).")]


def batch_scaling(df: pd.DataFrame) -> list[str]:
    out = [f"Paper: {PAPER['batch_scaling']}"]
    for policy, g in df[df["oom"]].groupby("policy"):
        out.append(f"Ours: {policy} ran out of device memory from batch {g['batch_size'].min()} "
                   f"(at {g['oom_where'].iloc[0]}).")
    d = df[~df["oom"]].copy()
    if d.empty:
        return out + ["Ours: no batch completed."]
    biggest = d["batch_size"].max()
    at = d[d["batch_size"] == biggest].groupby("policy").agg(
        tps=("decode_tokens_per_s", "mean"), device=("device_peak_bytes", "mean"), host=("host_peak_bytes", "mean"))
    at["per_gib"] = at["tps"] / (at["device"] / 2**30)
    best = at["tps"].idxmax()
    out.append(f"Ours: at batch {biggest} the highest decode throughput is {best} ({at.loc[best, 'tps']:.1f} tok/s).")
    for policy, row in at.iterrows():
        out.append(f"Ours: {policy} at batch {biggest}: {row['tps']:.1f} tok/s, device peak "
                   f"{row['device'] / 2**30:.2f} GiB, {row['per_gib']:.1f} tok/s per GiB, "
                   f"host peak {row['host'] / 2**30:.2f} GiB.")
    if VLLM in at.index and "paged" in at.index:
        out.append(f"Ours: kvlib's paged policy reaches {at.loc['paged', 'tps'] / at.loc[VLLM, 'tps']:.2f}x the real "
                   f"vLLM's decode throughput at batch {biggest} (how far kvlib's engine is from a production one).")
    # against the full cache, and against the real vLLM (the paper's H2O: ~3x vLLM's throughput per GB); each pair once
    references = [r for r in ("full", VLLM) if r in at.index]
    for i, reference in enumerate(references):
        for policy in at.index.drop(references[:i + 1]):
            ratio = at.loc[policy, "per_gib"] / at.loc[reference, "per_gib"]
            speed = at.loc[policy, "tps"] / at.loc[reference, "tps"]
            out.append(f"Ours: {policy} vs {reference} at batch {biggest}: {speed:.2f}x throughput, {ratio:.2f}x "
                       f"throughput per GiB of device memory.")
    if VLLM in at.index and "device_kv_reserved_peak_bytes" in d:
        pool = d.loc[(d["policy"] == VLLM) & (d["batch_size"] == biggest)].iloc[0]
        held = pool["device_kv_reserved_peak_bytes"] + pool["device_kv_peak_bytes"]
        out.append(f"Ours: {VLLM} preallocates its KV pool ({held / 2**30:.2f} GiB) and used "
                   f"{pool['device_kv_peak_bytes'] / 2**30:.2f} GiB of it at batch {biggest}: its device peak, and so "
                   f"its throughput per GiB, counts the whole pool.")
    return out


def decode_length(df: pd.DataFrame) -> list[str]:
    out = [f"Paper: {PAPER['decode_length']}"]
    d = df[~df["oom"]]
    for policy, g in d.groupby("policy"):
        g = g.sort_values("output_tokens")
        first, last = g.iloc[0], g.iloc[-1]
        change = last["decode_tokens_per_s"] / first["decode_tokens_per_s"] - 1
        out.append(f"Ours: {policy}: {first['decode_tokens_per_s']:.1f} tok/s at {first['output_tokens']} output "
                   f"tokens, {last['decode_tokens_per_s']:.1f} at {last['output_tokens']} ({change:+.0%}).")
    return out


def accuracy_table(df: pd.DataFrame) -> pd.DataFrame:
    """One score per (task, policy, budget): accuracy for multiple-choice tasks, word perplexity for rolling ones.
    The full cache has no budget: it is listed at budget 1.0."""
    d = df.assign(budget=df["budget"].fillna(1.0) if "budget" in df else 1.0)
    rows = []
    for (task, policy, budget), g in d.groupby(["task", "policy", "budget"]):
        if "correct" in g and g["correct"].notna().any():
            rows.append((task, policy, budget, "accuracy", g["correct"].mean(), len(g)))
        else:
            rows.append((task, policy, budget, "word perplexity", math.exp(-g["loglik"].sum() / g["words"].sum()),
                         len(g)))
    return pd.DataFrame(rows, columns=["task", "policy", "budget", "metric", "score", "items"])


def accuracy(df: pd.DataFrame) -> list[str]:
    out = [f"Paper: {PAPER['accuracy']}"]
    table = accuracy_table(df)
    for task, t in table.groupby("task"):
        full = t.loc[t["policy"] == "full", "score"]
        if full.empty:
            continue
        base, metric = full.iloc[0], t["metric"].iloc[0]
        unit = (lambda x: f"{x:.1%}") if metric == "accuracy" else (lambda x: f"{x:.2f}")
        out.append(f"Ours: {task} ({t['items'].iloc[0]} items), full cache {metric} {unit(base)}.")
        sparse = t[t["policy"] != "full"]
        for budget, b in sparse.groupby("budget"):
            parts = []
            for _, row in b.iterrows():
                delta = (f"{(row['score'] - base) * 100:+.1f} pp" if metric == "accuracy"
                         else f"{row['score'] / base - 1:+.1%}")
                parts.append(f"{row['policy']} {unit(row['score'])} ({delta})")
            out.append(f"Ours: {task} at budget {budget:g}: " + ", ".join(parts) + ".")
            verdict = _who_loses_more(b.set_index("policy")["score"], base, metric == "accuracy")
            if verdict:
                out.append(f"Ours: {task} at budget {budget:g}: {verdict}.")
    return out


def _who_loses_more(scores: pd.Series, base: float, higher_is_better: bool) -> str | None:
    """Whether H2O loses more than InfiniGen against the full cache (the paper's comparison); None if one is missing."""
    if not {"h2o", "infinigen"} <= set(scores.index):
        return None
    loss = {p: (base - scores[p]) if higher_is_better else (scores[p] - base) for p in ("h2o", "infinigen")}
    if math.isclose(loss["h2o"], loss["infinigen"], abs_tol=1e-6 * max(abs(base), 1.0)):  # float noise is no loss
        return "H2O and InfiniGen lose the same (paper: H2O loses more)"
    more = "H2O loses more than InfiniGen" if loss["h2o"] > loss["infinigen"] else "InfiniGen loses more than H2O"
    return f"{more} (paper: H2O loses more)"


def retention(df: pd.DataFrame) -> list[str]:
    out = [f"Paper: {PAPER['retention']}"]
    overall = df.groupby("policy")["correct"].mean()
    if "full" not in overall:
        return out + ["Ours: no full-cache run to compare with."]
    base = overall["full"]
    out.append(f"Ours: {len(df[df['policy'] == 'full'])} questions per policy; the full cache answers {base:.0%}.")
    for policy in overall.index.drop("full"):
        out.append(f"Ours: {policy} answers {overall[policy]:.0%} ({(overall[policy] - base) * 100:+.0f} pp).")
    by_bucket = df.groupby(["bucket", "policy"])["correct"].mean().unstack()
    for bucket, row in by_bucket.iterrows():
        out.append(f"Ours: bucket {bucket}: " + ", ".join(f"{p} {v:.0%}" for p, v in row.items()) + ".")
    verdict = _who_loses_more(overall, base, higher_is_better=True)
    return out + ([f"Ours: retention over all buckets and turns: {verdict}."] if verdict else [])


def markdown(lines: list[str]) -> str:
    """The sentences as a bulleted list, for a notebook's Markdown display."""
    return "\n".join(f"- {line}" for line in lines)
