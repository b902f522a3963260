"""The paper's Fig. 7 redrawn from the rows: six panels (PIQA, COPA, WinoGrande / HellaSwag, OpenBookQA, BoolQ),
accuracy against the KV budget, one line per policy (H2O per budget rule, InfiniGen at its official alpha), the full
cache as a horizontal band (its 95 % Wilson interval), each task's chance rate as a dashed line. Protocol one_pass,
the official harnesses' (the paper's numbers' own); one model (the one with the most rows), named in the title with the machine (kvlib.report.provenance)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from kvlib.report.accuracy.paper_tasks import ALPHA, PAPER_TASKS, read_rows, reading_model
from kvlib.report.figure_style import policy_colours, set_style
from kvlib.report.measures import wilson
from kvlib.report.provenance import suptitle

TITLES = {"piqa": "PIQA", "copa": "COPA", "winogrande": "WinoGrande", "hellaswag": "HellaSwag",
          "openbookqa": "OpenBookQA", "boolq": "BoolQ"}


def _label(row: pd.Series) -> str:
    """A line's name: H2O with its budget rule, InfiniGen with its alpha where the rows record them."""
    if row["policy"] == "h2o" and pd.notna(row.get("budget_rule")):
        return f"h2o ({row['budget_rule']})"
    if row["policy"] == "infinigen" and pd.notna(row.get("alpha")) and row["alpha"] != ALPHA:
        return f"infinigen (alpha {row['alpha']:g})"
    return str(row["policy"])


def fig7_points(df: pd.DataFrame) -> pd.DataFrame:
    """One row per task, line and budget: accuracy, its Wilson interval, items; the full cache at budget 1.0."""
    d = read_rows(df)
    model = reading_model(d)
    if d.empty:
        return pd.DataFrame(columns=["task", "line", "budget", "score", "low", "high", "items", "chance",
                                     "kv_share_attended"])
    d = d.assign(line=d.apply(_label, axis=1), chance=d["chance"] if "chance" in d else float("nan"))
    rows = []
    for (task, line, budget), g in d.groupby(["task", "line", "budget"]):
        low, high = wilson(g["correct"].sum(), len(g))
        shared = g["kv_share_attended"].mean() if "kv_share_attended" in g else float("nan")
        rows.append((task, line, budget, g["correct"].mean(), low, high, len(g), g["chance"].iloc[0], shared))
    return pd.DataFrame(rows, columns=["task", "line", "budget", "score", "low", "high", "items", "chance",
                                       "kv_share_attended"]).assign(model=model)


def fig7(df: pd.DataFrame):
    """The figure from the accuracy rows (kvlib.study.results.load's frame): empty panels say the task did not run."""
    set_style()
    points = fig7_points(df)
    fig, axes = plt.subplots(2, 3, figsize=(13, 7.5), sharex=True)
    lines = sorted(set(points["line"]) - {"full"})
    palette = policy_colours(lines)
    for ax, task in zip(axes.flat, PAPER_TASKS):
        t = points[points["task"] == task]
        ax.set(title=TITLES[task], xscale="log", xlabel="KV budget (share of entries kept)", ylabel="accuracy")
        if t.empty:
            ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes, color="grey")
            continue
        for line, g in t[t["line"] != "full"].groupby("line"):
            g = g.sort_values("budget")
            ax.errorbar(g["budget"], g["score"], yerr=[g["score"] - g["low"], g["high"] - g["score"]], marker="o",
                        capsize=3, color=palette[line], label=line)
        for _, row in t[t["line"] == "full"].iterrows():
            ax.axhspan(row["low"], row["high"], color="black", alpha=0.12)
            ax.axhline(row["score"], color="black", lw=1)
        if t["chance"].notna().any():
            ax.axhline(t["chance"].dropna().iloc[0], color="grey", ls="--", lw=1)
    budgets = sorted(points.loc[points["line"] != "full", "budget"].unique())
    for ax in axes.flat:
        ax.minorticks_off()
        if budgets:
            ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
    key = [plt.Line2D([], [], color="black", lw=6, alpha=0.2, label="full cache (band: 95 % Wilson)"),
           plt.Line2D([], [], color="grey", ls="--", label="chance (guessing)")]
    key += [plt.Line2D([], [], color=palette[n], marker="o", label=n) for n in lines]
    suptitle(fig, read_rows(df), title="Fig. 7 from the rows: accuracy against KV budget, protocol one_pass"
                               + ("" if len(points) else ", no rows"))
    fig.legend(handles=key, loc="lower center", ncol=min(len(key), 5), fontsize="small", frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    return fig
