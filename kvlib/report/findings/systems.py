"""The paper's poster table (hierarchical placement, sparsification, quantization, cache granularity, eviction, KV
utilization, batching), one row per runner, filled from what the runs recorded: where its KV lay and how many bytes
at the peak (measured, by tier), the share of the entries it had seen that decode attention read (measured), and the
mechanism each runner records with every run (KVPolicy.traits: what it keeps, reads and evicts, its allocation unit,
the bits of a stored element; and the schedule it ran under, kvlib.engine.scheduler.BATCHING). Read from the systems
experiments' completed runs: batch scaling, whose largest batch every runner of the book meets, and the offload
experiment, whose placements are FlexGen's."""

from __future__ import annotations

import pandas as pd

from kvlib.report.study_rows import StudyRows

TRAITS = {"stat_keeps": "keeps", "stat_reads": "attention reads", "stat_evicts": "evicts",
          "stat_granularity": "allocated in", "stat_kv_bits": "bits a stored element", "stat_batching": "batching"}
MIB = 2**20


def _runs(rows: StudyRows) -> pd.DataFrame:
    """The completed runs it reads: batch scaling's at its largest batch, and the offload experiment's."""
    parts = []
    for df, largest_batch in ((rows.batch_scaling, True), (rows.offload, False)):
        if df.empty:
            continue
        done = df[~df["oom"].astype(bool)]
        if largest_batch and not done.empty:
            done = done[done["batch_size"] == done["batch_size"].max()]
        parts.append(done)
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def _held(g: pd.DataFrame) -> str:
    """The tiers its KV lay on, each with the most it held there at a peak (kept and reserved) over its runs."""
    tiers = []
    for tier in ("device", "host", "disk"):
        cols = [c for c in (f"{tier}_kv_peak_bytes", f"{tier}_kv_reserved_peak_bytes") if c in g]
        peak = g[cols].fillna(0).sum(axis=1).max() if cols else 0
        if peak > 0:
            tiers.append(f"{tier} {peak / MIB:,.0f} MiB")
    return ", ".join(tiers) or "not recorded"


def table(rows: StudyRows) -> pd.DataFrame:
    runs = _runs(rows)
    if runs.empty:
        return pd.DataFrame()
    out = []
    for policy, g in runs.groupby("policy"):
        row = {"runner": policy, "KV held (peak, over its runs)": _held(g)}
        share = g["stat_kv_share_attended"] if "stat_kv_share_attended" in g else pd.Series(dtype=float)
        row["share of seen entries decode read"] = pd.to_numeric(share, errors="coerce").median()
        for col, label in TRAITS.items():
            values = g[col].dropna().unique() if col in g else []
            shown = [f"{v:g}" if isinstance(v, float) else str(v) for v in values]  # (bits: 4.5 for 4-bit records)
            row[label] = "; ".join(shown) or "not recorded"
        out.append(row)
    return pd.DataFrame(out).set_index("runner")


PARTS = {"Where the cache lives and how much of it decode reads": [
             "KV held (peak, over its runs)", "share of seen entries decode read", "allocated in",
             "bits a stored element", "batching"],
         "What each keeps, reads and evicts": ["keeps", "attention reads", "evicts"]}


def by_part(systems: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """`table` in two narrower tables (the placement and the rule), each a page wide."""
    return {part: systems[[c for c in columns if c in systems]] for part, columns in PARTS.items()}
