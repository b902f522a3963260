"""Sentences that read the results: each compares our measured numbers with a finding of the paper.

Every sentence is computed from a results frame; nothing here states a number it did not read.
"""

from __future__ import annotations

import pandas as pd

TITLES = {"ttft": "Time to first token", "batch_scaling": "Batch scaling", "decode_length": "Decode length"}

PAPER = {
    "ttft": "full-matrix prefill (needed by H2O's scores) runs out of memory at ~10K tokens on an 80 GB H100; fused "
            "attention rescues InfiniGen, chunked prefill rescues H2O.",
    "batch_scaling": "vLLM has the highest throughput; H2O matches it with far less device memory (~3x throughput "
                     "per GB); InfiniGen is an order of magnitude slower; InfiniGen's host memory grows with batch.",
    "decode_length": "throughput stays roughly flat with output length for vLLM and H2O; InfiniGen's per-step "
                     "transfers keep it far below.",
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
    return out


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
    if "full" in at.index:
        for policy in at.index.drop("full"):
            ratio = at.loc[policy, "per_gib"] / at.loc["full", "per_gib"]
            speed = at.loc[policy, "tps"] / at.loc["full", "tps"]
            out.append(f"Ours: {policy} vs full at batch {biggest}: {speed:.2f}x throughput, {ratio:.2f}x throughput "
                       f"per GiB of device memory.")
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


def markdown(lines: list[str]) -> str:
    """The sentences as a bulleted list, for a notebook's Markdown display."""
    return "\n".join(f"- {line}" for line in lines)
