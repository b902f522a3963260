"""The validity gate: a comparison of policies on a task (or a retention bucket) means something only where the full
cache passes it with that model. A task the full cache fails measures the model, not the policies: there the book
says the task is beyond the model and draws no verdict.

"Passes" is the full cache's mean score over the items at least the gate (a profile setting, `validity_gate`;
GATE by default). Scored units only: accuracy's multiple-choice tasks, each RULER subtask at each length, each
retention bucket; a perplexity has no pass mark and is never gated. A task whose rows carry its `chance` rate (the
paper's six benchmarks: kvlib.evaluation.paper_tasks) passes where the full cache is above chance instead: the lower
end of its score's 95 % Wilson interval over that rate. A fixed share would say nothing of them (a model far above
chance on HellaSwag may still score 40 %), and a drop measured where the full cache is at chance means nothing.
"""

from __future__ import annotations

import pandas as pd

from kvlib.report.measures import ruler_rows, scored_rows, wilson

GATE = 0.70  # the share of items the full cache must get right for a comparison on them to be reported


def _full(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["policy"] == "full"] if "policy" in df else df.iloc[0:0]


def _gated(df: pd.DataFrame, value: str, unit: list[str], gate: float) -> pd.DataFrame:
    """One row per model and unit: the full cache's mean `value`, its items, its chance rate where the rows carry
    one, and whether it passes (above chance where there is one, else at least the gate)."""
    columns = ["model", *unit, "full_score", "items", "chance", "passes"]
    full = _full(df).dropna(subset=[value]) if value in df else df.iloc[0:0]
    if full.empty:
        return pd.DataFrame(columns=columns)
    by = (["model"] if "model" in full else []) + unit
    full = full.assign(chance=full["chance"] if "chance" in full else float("nan"))
    out = full.groupby(by, dropna=False).agg(full_score=(value, "mean"), items=(value, "size"),
                                             chance=("chance", "first")).reset_index()
    if "model" not in out:
        out.insert(0, "model", None)
    out["full_score"] = out["full_score"].astype(float)
    passes = [score >= gate if pd.isna(chance) else wilson(score * n, n)[0] > chance
              for score, n, chance in zip(out["full_score"], out["items"], out["chance"])]
    return out.assign(passes=passes)[columns]


def accuracy_gate(df: pd.DataFrame, gate: float = GATE) -> pd.DataFrame:
    """The gate per model and scored task (multiple choice: `correct`); RULER per subtask and length."""
    scored = df[df["ruler_score"].isna()] if "ruler_score" in df else df
    tasks = _gated(scored, "correct", ["task"], gate).assign(length=pd.NA)
    ruler = _gated(df, "ruler_score", ["task", "length"], gate) if "ruler_score" in df else tasks.iloc[0:0]
    return pd.concat([tasks, ruler], ignore_index=True)[["model", "task", "length", "full_score", "items", "chance",
                                                         "passes"]]


def retention_gate(df: pd.DataFrame, gate: float = GATE) -> pd.DataFrame:
    """The gate per model and context-length bucket."""
    d = df.assign(correct=df["correct"].astype(float)) if "correct" in df else df
    return _gated(d, "correct", ["bucket"], gate)


def passing(gate_frame: pd.DataFrame, unit: str) -> set:
    """The values of `unit` (a task, a bucket) whose every gated row passes."""
    if gate_frame.empty:
        return set()
    verdicts = gate_frame.groupby(unit)["passes"].all()
    return set(verdicts[verdicts].index)


def beyond_model(gate_frame: pd.DataFrame, gate: float = GATE, what: str = "task") -> list[str]:
    """A sentence for each gated unit the full cache fails: the task is beyond the model, no verdict drawn."""
    out = []
    for _, row in gate_frame[~gate_frame["passes"].astype(bool)].iterrows():
        name = row.get("task", row.get("bucket"))
        at = f" at {int(row['length']):,} tokens" if pd.notna(row.get("length", pd.NA)) else ""
        model = f" with {row['model']}" if pd.notna(row["model"]) else ""
        below = (f"not above the {row['chance']:.0%} that guessing scores (the lower end of its 95 % Wilson interval)"
                 if pd.notna(row.get("chance", pd.NA)) else f"below the validity gate of {gate:.0%}")
        out.append(f"Ours: {what} {name}{at} is beyond the model{model}: the full cache scores "
                   f"{row['full_score']:.0%} on {row['items']} items, {below}; no verdict is drawn on the policies "
                   f"there.")
    return out


def passing_units(df: pd.DataFrame, gate: float = GATE) -> dict[str, tuple[pd.DataFrame, str, str | None]]:
    """label -> (rows, value column, stratum) for each scored unit the full cache passes: a multiple-choice task
    (`correct`), and RULER at one length over its passing subtasks (`ruler_score`, resampled within each; the strict
    protocol's rows where both ran: the paper scores every answer token, and two protocols are never pooled). Rows'
    budgets filled with 1.0 for the full cache."""
    units = {}
    gated = accuracy_gate(df, gate)
    scored = scored_rows(df)
    for task in sorted(passing(gated[gated["length"].isna()], "task")):
        rows = scored[scored["task"] == task]
        if "correct" in rows and rows["correct"].notna().any():
            units[task] = (rows, "correct", None)
    if "ruler_score" in df:
        ruler = ruler_rows(df)
        ok = gated[gated["length"].notna() & gated["passes"].astype(bool)]
        for length, g in ok.groupby("length"):
            kept = ruler[(ruler["length"] == length) & ruler["task"].isin(g["task"])]
            if "protocol" in kept and kept["protocol"].nunique() > 1:
                kept = kept[kept["protocol"] == "strict"]
            if not kept.empty:
                units[f"RULER at {int(length):,} tokens"] = (kept, "ruler_score", "task")
    return units
