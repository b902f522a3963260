"""The readings of a results frame that every chapter shares: spreads of repeated timings, the kernels and machines
rows ran on, accuracy rows and their items, Wilson's interval, and the rounded table the book shows. Each chapter's
module (kvlib.report.ttft, ..., kvlib.report.accuracy) reads these; none computes a number of its own."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

MIB = 2**20


def outside_label(df: pd.DataFrame) -> str | None:
    """The label of an outside engine's rows (the real vLLM), where the frame has them: rows say so themselves."""
    if "outside" not in df:
        return None
    labels = df.loc[df["outside"].fillna(False).astype(bool), "policy"].unique()
    return labels[0] if len(labels) else None


def decode_kernels(df: pd.DataFrame) -> dict[str, str]:
    """The decode attention each kvlib policy's rows record (`c`, `torch`; `mixed` where its rows differ,
    `unrecorded` where none says: results from before every policy recorded it). An outside engine decodes with its
    own kernels and is compared as an engine, not as a policy: it has no entry."""
    outside, kernels = outside_label(df), {}
    for policy, g in df.groupby("policy"):
        if policy == outside:
            continue
        values = set(g["stat_decode_attention"].dropna()) if "stat_decode_attention" in g else set()
        kernels[policy] = values.pop() if len(values) == 1 else ("mixed" if values else "unrecorded")
    return kernels


def same_kernel(kernels: dict[str, str], a: str, b: str) -> bool:
    """Whether a throughput comparison of a and b compares policies: both decoded with one recorded kernel, the same.
    An outside engine against anything is an engine comparison, which the kernels are part of."""
    if a not in kernels or b not in kernels:
        return True
    return kernels[a] == kernels[b] and kernels[a] not in ("mixed", "unrecorded")


def kernel_note(kernels: dict[str, str], policies) -> str | None:
    """A sentence saying which policies decoded with which kernel, where they are not all one."""
    used = {p: kernels[p] for p in policies if p in kernels}
    if len(set(used.values())) <= 1 and not set(used.values()) & {"mixed", "unrecorded"}:
        return None
    groups = {}
    for p, k in sorted(used.items()):
        groups.setdefault(k, []).append(p)
    return ("these policies did not all decode with the same attention kernel (" + "; ".join(
        f"{k}: {', '.join(ps)}" for k, ps in sorted(groups.items())) + "): their throughputs are compared only "
        "between policies of one kernel, since across kernels the difference would be the kernels'")


def machine_kind(df: pd.DataFrame) -> pd.Series:
    """Per row, the kind of machine that measured it: CPU model and GPU (kvlib.study.machine's columns), which set a
    timing's speed; host and Ray node do not (two like machines measure alike). `unrecorded` for rows from before the
    columns were recorded."""
    if "machine_cpu" not in df:
        return pd.Series("unrecorded", index=df.index)
    gpu = df["machine_gpu"].fillna("no GPU") if "machine_gpu" in df else pd.Series("no GPU", index=df.index)
    kind = df["machine_cpu"].astype("string") + " with " + gpu.astype("string")
    return kind.fillna("unrecorded").astype(str)


@dataclass
class Spread:
    """A measured figure: its centre (the geometric mean over repeats: the book's one ratio is of geometric means) and
    the range it was seen in (over repeats, or over the steps of a run)."""

    centre: float
    low: float
    high: float
    n: int = 1  # measurements the range comes from (repeats, or decode steps)

    def overlaps(self, other: Spread) -> bool:
        return self.low <= other.high and other.low <= self.high

    def __format__(self, spec: str) -> str:
        if f"{self.low:{spec}}" == f"{self.high:{spec}}":
            return f"{self.centre:{spec}}"
        return f"{self.centre:{spec}} ({self.low:{spec}}-{self.high:{spec}})"


def geometric_mean(values) -> float:
    """The centre every timing is read by (positive figures; NaN where there are none)."""
    v = pd.to_numeric(pd.Series(values), errors="coerce").dropna()
    v = v[v > 0]
    return float(np.exp(np.log(v).mean())) if len(v) else float("nan")


def ttft_spread(g: pd.DataFrame) -> Spread:
    """TTFT over the repeats of a point (min to max)."""
    return Spread(geometric_mean(g["ttft_s"]), g["ttft_s"].min(), g["ttft_s"].max(), len(g))


def decode_spread(g: pd.DataFrame) -> Spread:
    """Decode throughput: the geometric mean over repeats; the range spans every repeat's interquartile range of per-step
    throughput (and the repeats themselves)."""
    tps = g["decode_tokens_per_s"]
    q1, q3 = g.get("decode_tokens_per_s_q1"), g.get("decode_tokens_per_s_q3")
    steps = q1 is not None and q1.notna().all()
    low = min(tps.min(), q1.min()) if steps else tps.min()
    high = max(tps.max(), q3.max()) if steps else tps.max()
    return Spread(geometric_mean(tps), low, high, int(g["decode_steps"].sum()) if steps and "decode_steps" in g else len(g))


def ratio(a: Spread, b: Spread) -> Spread:
    return Spread(a.centre / b.centre, a.low / b.high, a.high / b.low, min(a.n, b.n))


def accuracy_item(df: pd.DataFrame) -> list[str]:
    """The columns naming an accuracy item, the same for every policy (same tasks, seeds and lengths): the task, its
    document, and the length the item was built at where rows record one (RULER's, kvlib's recall)."""
    return ["task", "doc_id"] + (["length"] if "length" in df else [])


def retention_design(df: pd.DataFrame) -> tuple[list[str], list[str], str | None]:
    """Retention's item (a question: conversation and turn), its cluster (the conversation: its questions share one
    context) and its stratum (the context-length bucket, a design choice rather than a sample), as columns."""
    bucket = ["bucket"] if "bucket" in df else []
    return bucket + ["conversation", "turn"], bucket + ["conversation"], ("bucket" if bucket else None)


def wilson(correct: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson interval of a share of n binary outcomes (honest for small n: 12 recall items, one is 8 pp)."""
    if n == 0:
        return (math.nan, math.nan)
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # at p = 0 or 1 the bound is p itself, which rounding misses by 1e-16 (an interval that excludes its own share)
    return min(max(centre - half, 0.0), p), max(min(centre + half, 1.0), p)


def budgeted(df: pd.DataFrame) -> pd.DataFrame:
    """The rows with the full cache's missing budget read as 1.0 (it keeps every entry), as every reading by budget
    takes it."""
    return df.assign(budget=df["budget"].fillna(1.0) if "budget" in df else 1.0)


def scored_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The accuracy rows scored per item (multiple choice, perplexity), RULER's aside, budgeted."""
    return budgeted(df[df["ruler_score"].isna()] if "ruler_score" in df else df)


def ruler_rows(df: pd.DataFrame) -> pd.DataFrame:
    """RULER's accuracy rows, budgeted."""
    return budgeted(df[df["ruler_score"].notna()])


def book_table(df: pd.DataFrame, index, columns: str, value: str, label: str, fmt: str = "{:.3g}",
               aggfunc=None, scale: float = 1.0) -> pd.DataFrame:
    """A table as the book shows it: `value` per `index` x `columns` (unless told: a timing's geometric mean over the
    repeats, the book's one centre of a timing; any other figure's median), rounded by `fmt`, under a header naming
    it with its unit; a point that ran out of device memory reads "OOM"."""
    if aggfunc is None:
        aggfunc = geometric_mean if value.endswith("_s") else "median"  # seconds and tokens per second
    oom = df["oom"].astype(bool) if "oom" in df else pd.Series(False, index=df.index)
    table = df[~oom].pivot_table(index=index, columns=columns, values=value, aggfunc=aggfunc) * scale
    table = table.map(lambda x: "" if pd.isna(x) else fmt.format(x))
    if oom.any():
        failed = df.assign(oom=oom).pivot_table(index=index, columns=columns, values="oom", aggfunc="any")
        table = table.reindex(index=failed.index, columns=failed.columns, fill_value="")
        table = table.mask(failed.fillna(False).astype(bool), "OOM")
    table.columns = pd.MultiIndex.from_product([[label], table.columns], names=[None, columns.replace("_", " ")])
    return table
