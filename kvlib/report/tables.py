"""Data tables read from results frames: spreads of repeated measurements, accuracy and retention scores with their
intervals, and the rounded tables the book shows. The sentences (kvlib.report.timing_lines, accuracy_lines,
verdicts), the figures (kvlib.report.plots), the chooser and the command line all read these; none of them computes a
number of its own.
"""

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
    return max(centre - half, 0.0), min(centre + half, 1.0)


def _perplexity_interval(g: pd.DataFrame, draws: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95 % bootstrap interval of word perplexity, resampling the documents."""
    rng = np.random.default_rng(seed)
    loglik, words = g["loglik"].to_numpy(), g["words"].to_numpy()
    picks = rng.integers(0, len(g), size=(draws, len(g)))
    values = np.exp(-loglik[picks].sum(axis=1) / words[picks].sum(axis=1))
    return float(np.quantile(values, 0.025)), float(np.quantile(values, 0.975))


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


def accuracy_table(df: pd.DataFrame) -> pd.DataFrame:
    """One score per (task, policy, budget) with its 95 % interval: accuracy (Wilson) for multiple-choice tasks, word
    perplexity (bootstrap over documents) for rolling ones; and the KV share the policy actually attended while
    scoring. The full cache has no budget: it is listed at budget 1.0. RULER's rows are left to `ruler_table`."""
    d = scored_rows(df)
    rows = []
    for (task, policy, budget), g in d.groupby(["task", "policy", "budget"]):
        attended = g["kv_share_attended"].median() if "kv_share_attended" in g else math.nan
        if "correct" in g and g["correct"].notna().any():
            low, high = wilson(g["correct"].sum(), len(g))
            rows.append((task, policy, budget, attended, "accuracy", g["correct"].mean(), low, high, len(g)))
        else:
            score = math.exp(-g["loglik"].sum() / g["words"].sum())
            rows.append((task, policy, budget, attended, "word perplexity", score, *_perplexity_interval(g), len(g)))
    return pd.DataFrame(rows, columns=["task", "policy", "budget", "kv_share_attended", "metric", "score", "low",
                                       "high", "items"])



SPECULATION = {"kv_share_attended": "share of the seen entries attended", "speculation_coverage":
               "attention mass its picks carried", "oracle_coverage": "mass the best picks of that count carry",
               "speculation_recall": "recall (picks / best)"}


def speculation_markdown(df: pd.DataFrame) -> str:
    """InfiniGen's selection as it ran, per task and budget (its cap): the share of the seen entries its decode steps
    attended (the dense layers and each step's new token included), the true attention mass of a sparse layer its
    speculated picks carried, the mass the oracle's best picks of the same count would carry, and their ratio
    (measure_coverage; kvlib.policies.infinigen). Each point's value over all its items."""
    rows = df[df["policy"] == "infinigen"] if "policy" in df else df.iloc[:0]
    if rows.empty or "speculation_recall" not in rows or rows["speculation_recall"].isna().all():
        return "InfiniGen's speculation was not measured in these results (`measure_coverage` unset)."
    table = rows.groupby(["task", "budget"])[list(SPECULATION)].median().reset_index()
    lines = ["| task | budget (cap) | " + " | ".join(SPECULATION.values()) + " |", "|---|---|" + "---|" * len(SPECULATION)]
    for r in table.itertuples(index=False):
        lines.append(f"| {r.task} | {r.budget:g} | " + " | ".join(f"{getattr(r, c):.1%}" for c in SPECULATION) + " |")
    return "\n".join(lines)


def retention_table(df: pd.DataFrame) -> pd.DataFrame:
    """Share of questions answered correctly per policy and protocol (two measurements, never pooled) with its 95 %
    Wilson interval over the questions and the KV share attended."""
    rows = []
    keys = ["policy", "protocol"] if "protocol" in df else ["policy"]
    for key, g in df.groupby(keys):
        attended = g["kv_share_attended"].median() if "kv_share_attended" in g else math.nan
        rows.append((*key, g["correct"].mean(), *wilson(g["correct"].sum(), len(g)), len(g), attended))
    return pd.DataFrame(rows, columns=[*keys, "score", "low", "high", "items", "kv_share_attended"]).assign(
        metric="accuracy").set_index(keys)




def _bootstrap_mean(groups: list[np.ndarray], draws: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95 % bootstrap interval of the mean over groups of the groups' mean item score, resampling items within each
    group (one group: one subtask's items at one length)."""
    rng = np.random.default_rng(seed)
    means = np.mean([s[rng.integers(0, len(s), size=(draws, len(s)))].mean(axis=1) for s in groups], axis=0)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def ruler_table(df: pd.DataFrame) -> pd.DataFrame:
    """RULER: one score per (task, length, policy, budget), the mean string-match score of its items (RULER's metric,
    per item the share of expected strings found in the answer), with a 95 % bootstrap interval over the items; and a
    `mean` task per (length, policy, budget), the unweighted mean over the subtasks run there (as RULER averages its
    tasks). The full cache is listed at budget 1.0."""
    columns = ["task", "length", "policy", "budget", "kv_share_attended", "metric", "score", "low", "high", "items"]
    if "ruler_score" not in df or df["ruler_score"].isna().all():
        return pd.DataFrame(columns=columns)
    d = ruler_rows(df)
    rows = []
    for (length, policy, budget), point in d.groupby(["length", "policy", "budget"]):
        attended = point["kv_share_attended"].median() if "kv_share_attended" in point else math.nan
        groups = {task: g["ruler_score"].to_numpy(float) for task, g in point.groupby("task")}
        for task, scores in groups.items():
            rows.append((task, length, policy, budget, attended, "string match", scores.mean(),
                         *_bootstrap_mean([scores]), len(scores)))
        rows.append(("mean", length, policy, budget, attended, "string match",
                     float(np.mean([s.mean() for s in groups.values()])), *_bootstrap_mean(list(groups.values())),
                     sum(map(len, groups.values()))))
    return pd.DataFrame(rows, columns=columns)


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
