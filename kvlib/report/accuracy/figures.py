"""The accuracy chapter's figures of the book's own tasks (the paper's six: kvlib.report.accuracy.fig7): scores
against the KV share attended, recall by context length, RULER against the budget."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from kvlib.report.figure_style import policy_colours, set_style
from kvlib.report.provenance import suptitle


def accuracy(table: pd.DataFrame, rows: pd.DataFrame | None = None):
    """Paper Fig. 7: one panel per task, score against the KV share each policy actually attended (its configured
    budget as the point's marker), 95 % intervals as bars, the full cache as a dashed line with its band; the key below
    the panels (eleven policies' names written beside their points covered each other). The model and machine above
    them, from `rows` (the table's rows) where given, else from the table."""
    set_style()
    tasks = sorted(table["task"].unique())
    fig, axes = plt.subplots(1, len(tasks), figsize=(max(9.0, 5.5 * len(tasks)), 6), squeeze=False)
    palette = policy_colours(table["policy"])
    budgets = sorted(table.loc[table["policy"] != "full", "budget"].dropna().unique())
    shapes = {b: "vsD^Po*X"[i % 8] for i, b in enumerate(budgets)}
    for ax, task in zip(axes.flat, tasks):
        t = table[table["task"] == task]
        for policy, g in t[t["policy"] != "full"].groupby("policy"):
            g = g.sort_values("kv_share_attended")
            ax.errorbar(g["kv_share_attended"], g["score"], yerr=[g["score"] - g["low"], g["high"] - g["score"]],
                        capsize=3, color=palette[policy])
            for budget, at in g.groupby("budget"):
                ax.scatter(at["kv_share_attended"], at["score"], marker=shapes[budget], s=40,
                           color=palette[policy], edgecolors="black", linewidths=0.5, zorder=3)
        for _, row in t[t["policy"] == "full"].iterrows():
            ax.axhline(row["score"], color="black", ls="--", lw=1)
            ax.axhspan(row["low"], row["high"], color="black", alpha=0.08)
        ax.set(xscale="log", yscale="log" if t["metric"].iloc[0] == "word perplexity" else "linear",
               xlabel="KV share attended during decode", ylabel=t["metric"].iloc[0], title=task)
    key = [plt.Line2D([], [], color="black", ls="--", label="full cache (band: 95 %)")]
    key += [plt.Line2D([], [], color=palette[p], label=p) for p in sorted(set(table["policy"]) - {"full"})]
    key += [plt.Line2D([], [], ls="", marker=shapes[b], color="grey", mec="black", label=f"configured budget {b:g}")
            for b in budgets]
    columns = 3 if len(tasks) == 1 else 4
    suptitle(fig, table if rows is None else rows)
    fig.legend(handles=key, loc="lower center", ncol=columns, fontsize="small", frameon=False)
    fig.tight_layout(rect=(0, 0.03 + 0.04 * -(-len(key) // columns), 1, 1))
    return fig


def recall_by_length(df: pd.DataFrame):
    """Recall accuracy vs context length, one panel per budget (the full cache in each)."""
    set_style()
    d = df[df["task"] == "kvlib_recall"].copy()
    full = d[d["policy"] == "full"]
    budgets = sorted(d["budget"].dropna().unique())
    fig, axes = plt.subplots(1, len(budgets), figsize=(4 * len(budgets), 3.6), sharey=True, squeeze=False)
    for ax, budget in zip(axes.flat, budgets):
        panel = pd.concat([full, d[d["budget"] == budget]])
        sns.lineplot(panel, x="length", y="correct", hue="policy", palette=policy_colours(d["policy"]), marker="o",
                     errorbar=None, ax=ax,
                     legend=ax is axes.flat[-1])
        ax.set(xscale="log", xlabel="context length (tokens)", ylabel="recall accuracy", title=f"budget {budget:g}")
    suptitle(fig, df)
    fig.tight_layout()
    return fig


def ruler(table: pd.DataFrame, task: str = "mean", rows: pd.DataFrame | None = None):
    """RULER score vs KV budget, one line per policy, one panel per length (kvlib.report.accuracy.tables.ruler_table; `task`: one
    subtask or `mean`, the mean over the subtasks); bars: 95 % bootstrap interval over the items; the full cache as a
    dashed line with its band. The model and machine in the title, from `rows` where given, else from the table."""
    set_style()
    t = table[table["task"] == task]
    lengths = sorted(t["length"].unique())
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 3.8), sharey=True, squeeze=False)
    palette = policy_colours(table["policy"])
    for ax, length in zip(axes.flat, lengths):
        at = t[t["length"] == length]
        for policy, g in at[at["policy"] != "full"].groupby("policy"):
            g = g.sort_values("budget")
            ax.errorbar(g["budget"], g["score"], yerr=[g["score"] - g["low"], g["high"] - g["score"]], marker="o",
                        capsize=3, label=policy, color=palette[policy])
        for _, row in at[at["policy"] == "full"].iterrows():
            ax.axhline(row["score"], color="black", ls="--", lw=1, label="full cache")
            ax.axhspan(row["low"], row["high"], color="black", alpha=0.08)
        ax.set(xscale="log", ylim=(-0.03, 1.03), xlabel="configured KV budget",
               ylabel=f"RULER score ({task})", title=f"{length:,} tokens")
        ax.legend(fontsize="small")
    suptitle(fig, table if rows is None else rows,
             title=f"RULER {'mean over subtasks' if task == 'mean' else task} vs KV budget (bars: 95 % interval)")
    fig.tight_layout()
    return fig
