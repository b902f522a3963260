"""Finding 2's tested claims (the paper's "similar peak throughput", "~3x per GB", "an order of magnitude", "the
lowest TTFT"), each a ratio of by-round means read at the largest batch every claim's runners completed, or untested
and saying why (kvlib.report.findings.verdicts combines them into the finding's verdict)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kvlib.report import stats
from kvlib.report.claims import NAMES, UNTESTED
from kvlib.report.measures import outside_label


@dataclass
class ThroughputClaims:
    """Finding 2's declared claims as these rows test them: the claims (each with what its refutation shows, read
    below its range and above it), the batch they are read at, the declared claims left untested with why, and the
    per-GB ratio against the configured capacity."""

    claims: list[stats.RangeClaim] = field(default_factory=list)
    refuted_as: list[tuple[str, str]] = field(default_factory=list)
    batch: int | None = None
    untested: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unconfirmable: bool = False  # the configured capacity alone keeps the finding from being confirmed


def _geometric_ratio(a: pd.Series, b: pd.Series) -> float:
    return float(np.exp(np.log(a).mean() - np.log(b).mean()))


def throughput_claims(df: pd.DataFrame) -> ThroughputClaims:
    """Finding 2 as the family of claims the verdict rests on, the paper's words as ranges of ratios of geometric
    means (kvlib.report.stats.range_claim), at the largest batch of the grid the claims' runners ran: a claim whose
    runner did not complete that batch (out of memory, say) is untested there, said so, never dropped. The device
    peaks are booked bytes, the same every run, so the throughput-per-GB claim is a throughput claim with its range
    scaled by the configured device memories: tested only where that range meets "similar throughput" (elsewhere the
    configuration alone rules the finding out)."""
    outside = outside_label(df)
    if outside is None or df.empty:
        return ThroughputClaims()
    runners = (outside, "h2o", "infinigen")
    mine = df[df["policy"].isin(runners)]
    if mine.empty:
        return ThroughputClaims()
    batch = int(mine["batch_size"].max())
    done = df[~df["oom"].astype(bool)]
    big = done[done["batch_size"] == batch]
    runs = {p: stats.by_round(g, "decode_tokens_per_s") for p, g in big.groupby("policy") if p in runners}
    out = ThroughputClaims(batch=batch)

    def absent(*names) -> str | None:
        return next((_absent(mine, p, batch) for p in names if p not in runs), None)

    def claim(name, a, b, low, high, below, above="", scale=1.0):
        if absent(a, b):
            out.untested.append(f"{name}: {UNTESTED} ({absent(a, b)})")
            return
        out.claims.append(stats.range_claim(name, runs[a] * scale, runs[b], low, high))
        out.refuted_as.append((below, above))

    margin = 1 + stats.EQUIVALENCE_TIMING  # the paper: "similar peak throughput", "comparable to vLLM"
    claim(f"h2o's decode throughput within +-{stats.EQUIVALENCE_TIMING:.0%} of {outside}'s", "h2o", outside,
          1 / margin, margin, f"H2O slower than {outside} by more than \"similar\"",
          f"H2O faster than {outside} by more than \"similar\"")
    claim(f"{outside} faster than infinigen", outside, "infinigen", 1.0, math.inf, f"InfiniGen faster than {outside}")
    if not one_memory(df):
        claim(f"{outside} / infinigen an order of magnitude (10x within a factor of sqrt(10))", outside, "infinigen",
              10 / 10**0.5, 10 * 10**0.5, f"InfiniGen closer to {outside} than an order of magnitude",
              f"InfiniGen further below {outside} than an order of magnitude")
    per_gb = f"h2o's throughput per GB ~3x {outside}'s (within a factor of sqrt(2))"
    memory = _device_ratio(big, outside)
    if absent("h2o", outside) or memory is None:
        out.untested.append(f"{per_gb}: {UNTESTED} ({absent('h2o', outside) or 'no booked device memory recorded'})")
    else:
        low, high = 3 / 2**0.5 / memory, 3 * 2**0.5 / memory  # the per-GB range as a throughput range
        out.notes.append(_per_gb_note(df, big, runs, outside, memory))
        if low <= margin and 1 / margin <= high:
            claim(per_gb, "h2o", outside, 3 / 2**0.5, 3 * 2**0.5, f"H2O's throughput per GB below ~3x {outside}'s",
                  f"H2O's throughput per GB above ~3x {outside}'s", scale=memory)
        else:
            out.unconfirmable = True
            out.untested.append(
                f"{per_gb}: {UNTESTED} at this capacity (~3x per GB needs H2O at {low:.2f}-{high:.2f}x {outside}'s "
                f"throughput, \"similar\" {1 / margin:.2f}-{margin:.2f}x: the two cannot both hold, so the finding "
                f"cannot be confirmed here, whatever the timings)")
    _lowest_ttft(done, mine, outside, out)
    return out


def _absent(rows: pd.DataFrame, policy: str, batch: int) -> str:
    """Why a runner has no completed run at a batch: out of memory there, or not run there."""
    at = rows[(rows["policy"] == policy) & (rows["batch_size"] == batch)]
    return f"{policy} ran out of device memory at batch {batch}" if not at.empty else f"{policy} did not run at batch {batch}"


def _device_ratio(big: pd.DataFrame, outside: str) -> float | None:
    """The device memory the outside runner books over H2O's at the batch read (booked bytes, the same every run)."""
    if "device_peak_bytes" not in big:
        return None
    device = big.groupby("policy")["device_peak_bytes"].median()
    if outside not in device or "h2o" not in device or not device["h2o"] > 0:
        return None
    return float(device[outside] / device["h2o"])


def _per_gb_note(df: pd.DataFrame, big: pd.DataFrame, runs: dict, outside: str, memory: float) -> str:
    """H2O's throughput per GB against the outside runner's, as the configured capacity sets it: the throughput ratio
    times the ratio of booked device memories, and the capacity at which similar throughput would give ~3x."""
    device = big.groupby("policy")["device_peak_bytes"].median()
    text = f"h2o's throughput per GB against {outside}'s, as the configured capacity sets it"
    if "h2o" in runs and outside in runs:
        speed = _geometric_ratio(runs["h2o"], runs[outside])
        text += f": {speed * memory:.2f}x, its throughput {speed:.2f}x times"
    text += (f" the {memory:.2f}x device memory {outside} books over H2O's ({device[outside] / 2**30:.2f} GiB against "
             f"{device['h2o'] / 2**30:.2f} GiB, booked, the same every run)")
    capacity = df["device_capacity_gb"].dropna() if "device_capacity_gb" in df else pd.Series(dtype=float)
    if capacity.nunique() == 1:
        gib = float(capacity.iloc[0])
        text += (f", {outside} booking {device[outside] / 2**30 / gib:.0%} of the configured {gib:g} GiB capacity: "
                 f"booking the same share of about {gib * 3 / memory:.3g} GiB, similar throughput would give ~3x per GB")
    return text


def _lowest_ttft(done: pd.DataFrame, mine: pd.DataFrame, outside: str, out: ThroughputClaims) -> None:
    """The paper's "vLLM delivers the lowest TTFT", at the smallest batch (one request's prefill, no queue): each of
    H2O's and InfiniGen's TTFT over vLLM's above 1 (untested, with why, where a runner lacks a TTFT there)."""
    batch = int(mine["batch_size"].min())
    small = done[(done["batch_size"] == batch) & done["policy"].isin(mine["policy"].unique())]
    column = "ttft_s" if "ttft_s" in small else None
    runs = {p: stats.by_round(g, column) for p, g in small.groupby("policy") if column and g[column].notna().any()}
    for p in ("h2o", "infinigen"):
        name = f"{outside}'s TTFT below {p}'s at batch {batch}"
        if p in runs and outside in runs:
            out.claims.append(stats.range_claim(name, runs[p], runs[outside], 1.0))
            out.refuted_as.append((f"{NAMES[p]}'s TTFT below {outside}'s", ""))
        else:
            why = "no TTFT recorded" if column is None else _absent(mine, next(r for r in (outside, p) if r not in runs),
                                                                     batch)
            out.untested.append(f"{name}: {UNTESTED} ({why})")


def one_memory(df: pd.DataFrame) -> bool:
    """The rows ran where host and device are one memory (a CPU): no bus for a tier's copies to cross."""
    return "device_name" in df and bool((df["device_name"] == "cpu").all())
