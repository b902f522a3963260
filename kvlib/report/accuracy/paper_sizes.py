"""Finding 4's losses across model sizes: the book's own reading, not a claim of the paper (which ran one model), so
it stands beside the verdict and never in it. On the paper's six tasks under the official protocol (one_pass), H2O
under FlexGen's rule and InfiniGen at its official alpha (kvlib.report.accuracy.paper_tasks.point), each model's
task-average drop from its own full cache at budgets 0.5 and 0.1, over the tasks whose full cache passes the validity
gate on EVERY model (so that every model's average reads the same tasks), and the trend of the loss at 0.1 with
size: the least-squares slope of the drop against log10 of the model's parameters (pp per tenfold), its interval
from each model's items resampled within their tasks, the models independent (kvlib.report.stats.slope). Its word:
the loss shrinks with model size (the interval below 0), grows (above 0), else no trend is shown. What a reader may
carry toward the paper's 8B model follows from that word and nothing else (`carry`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from kvlib.report import stats
from kvlib.report.accuracy.paper_tasks import ITEM, PAPER_TASKS, paper_rows, point
from kvlib.report.drop_words import signed_pp
from kvlib.report.figure_style import policy_colours, set_style
from kvlib.report.gate import accuracy_gate, passing
from kvlib.report.pages import ACCURACY
from kvlib.report.provenance import model_name, suptitle
from kvlib.report.stats.accuracy import draws_for
from kvlib.report.stats.rule import SEED
from kvlib.report.stats.slope import slope
from kvlib.report.stats.task_average import replicates

BUDGETS = (0.5, 0.1)
TREND_BUDGET = 0.1  # the paper's "InfiniGen loses ~6 pp, H2O more" is read at 0.1
POLICIES = ("h2o", "infinigen")
PAPER_MODEL, PAPER_PARAMETERS = "Llama-3.1-8B", 8_030_261_248  # Fig. 7's model and its model card's count
SHRINKS, GROWS, NOT_SHOWN = "shrinks", "grows", "no trend shown"
# the accuracy page's section, its share divided between the two policies' trends; the findings page shows the same
# lines (beside finding 4, never in its family), so they are read at this level wherever they are printed
LEVEL = ACCURACY.level("model size", intervals=len(POLICIES))


def parameters(model: str) -> int | None:
    """A model's parameter count where kvlib knows it (the embedded models'); else None (left off the size axis)."""
    from kvlib.models.embedded import EMBEDDED_MODELS  # (torch with it: only when a page reads model sizes)

    entry = EMBEDDED_MODELS.get(model)
    return entry.parameters if entry else None


def _sized_models(d: pd.DataFrame) -> set:
    """The models of known size that ran the full cache on the paper's tasks (`d`: paper_rows)."""
    if d.empty or "model" not in d:
        return set()
    return {m for m in d.loc[d["policy"] == "full", "model"].dropna().unique() if parameters(str(m)) is not None}


def has_sizes(df: pd.DataFrame) -> bool:
    """Whether the rows hold the paper's tasks' full cache on two models of known size or more: a trend to read."""
    return len(_sized_models(paper_rows(df))) >= 2


def _is_paper_model(model: str) -> bool:
    return PAPER_MODEL.lower() in model.lower()


def reads_own(df: pd.DataFrame) -> bool:
    """Whether the size section reads these rows rather than another book's: they hold a trend, or the paper's own
    model (whose losses need no small models' trend carried to them)."""
    d = paper_rows(df)
    return has_sizes(df) or ("model" in d and any(_is_paper_model(str(m)) for m in d["model"].dropna().unique()))


def sized_rows(df: pd.DataFrame, gate: float) -> tuple[pd.DataFrame, list[str]]:
    """The paper's tasks' one-pass rows of the models of known size that ran the full cache, on the tasks whose full
    cache passes the gate on every one of them; and those tasks."""
    d = paper_rows(df)
    d = d[d["model"].isin(_sized_models(d))] if "model" in d else d.iloc[0:0]
    if d.empty:
        return d, []
    gated = accuracy_gate(d, gate)
    everywhere = gated.groupby("task")["model"].nunique() == d["model"].nunique()
    tasks = [t for t in PAPER_TASKS if t in passing(gated, "task") and everywhere.get(t, False)]
    return d[d["task"].isin(tasks)], tasks


def _paired(full: pd.DataFrame, at: pd.DataFrame) -> pd.DataFrame:
    """Each item both ran: its task and the loss (full - policy) on it."""
    joined = full[ITEM + ["correct"]].merge(at[ITEM + ["correct"]], on=ITEM, suffixes=("_full", ""))
    return joined.assign(loss=joined["correct_full"] - joined["correct"])


def drops(df: pd.DataFrame, gate: float, level: float = LEVEL) -> pd.DataFrame:
    """One row a model, policy and budget: the task-average drop over the common gated tasks, its interval (the
    stratified bootstrap of stats.task_average), the items and the parameters. Empty where under two models run."""
    d, tasks = sized_rows(df, gate)
    rows = []
    for model, m in d.groupby("model"):
        full = m[m["policy"] == "full"]
        for policy in POLICIES:
            for budget in BUDGETS:
                at = point(m, policy, budget)
                if at.empty:
                    continue
                dr = stats.task_average_drop(full, at, "correct", ITEM, level=level)
                rows.append({"model": model, "name": model_name(str(model)), "parameters": parameters(str(model)),
                             "policy": policy, "budget": budget, "drop": dr.drop, "low": dr.low, "high": dr.high,
                             "items": dr.items, "effective": dr.clusters, "tasks": ", ".join(tasks)})
    out = pd.DataFrame(rows, columns=["model", "name", "parameters", "policy", "budget", "drop", "low", "high",
                                      "items", "effective", "tasks"]).sort_values(
        ["parameters", "policy", "budget"], ascending=[True, True, False], ignore_index=True)
    return out if out["model"].nunique() >= 2 else out.iloc[0:0]


@dataclass(frozen=True)
class Trend:
    """The slope of one policy's task-average loss at TREND_BUDGET against log10(parameters), in shares per tenfold."""

    policy: str
    models: tuple[str, ...]  # smallest first
    slope: float
    low: float
    high: float
    level: float

    @property
    def word(self) -> str:
        return SHRINKS if self.high < 0 else GROWS if self.low > 0 else NOT_SHOWN

    def described(self) -> str:
        """The slope and its interval, no word (as the findings page prints it, outside its family)."""
        return (f"{self.policy}'s loss at budget {TREND_BUDGET:g} across {', '.join(self.models)}: "
                f"{self.slope * 100:+.1f} pp per tenfold parameters, {self.level:.2%} interval "
                f"{self.low * 100:+.1f} to {self.high * 100:+.1f}")

    def line(self) -> str:
        """With its word: the accuracy page's tested statement."""
        return f"{self.described()}: {self.word}"

    def sentence(self) -> str:
        """The word in a sentence, its slope beside it."""
        moves = "shows no trend" if self.word == NOT_SHOWN else self.word
        return (f"{self.policy}'s loss at {TREND_BUDGET:g} {moves} with model size ({self.slope * 100:+.1f} pp per "
                f"tenfold, {self.low * 100:+.1f} to {self.high * 100:+.1f})")


def trend(df: pd.DataFrame, gate: float, policy: str, level: float = LEVEL) -> Trend | None:
    """`policy`'s trend over the models that ran it at TREND_BUDGET (None under two)."""
    d, _ = sized_rows(df, gate)
    n = draws_for(level)
    sizes, estimates, reps, floors, names = [], [], [], [], []
    for model, m in sorted(d.groupby("model"), key=lambda kv: parameters(str(kv[0]))):
        pairs = _paired(m[m["policy"] == "full"], point(m, policy, TREND_BUDGET))
        if pairs.empty:
            continue
        per_task = pairs.groupby("task")["loss"]
        sizes.append(math.log10(parameters(str(model))))
        estimates.append(float(per_task.mean().mean()))  # the task average, as stats.task_average weighs it
        # each model its own draws: the models' items resampled independently (the same seeds would pick the same
        # positions in every model's items, a pairing the rows' order does not promise)
        reps.append(replicates(pairs["loss"], pairs["task"], n, seed=SEED + 1000 * len(reps)))
        floors.append(stats.resolution(math.floor(stats.effective_items(per_task.size())), level))
        names.append(model_name(str(model)))
    if len(sizes) < 2:
        return None
    return Trend(policy, tuple(names), *slope(sizes, estimates, reps, floors, level), level)


def lines(df: pd.DataFrame, gate: float, level: float = LEVEL, worded: bool = False) -> list[str]:
    """The reading beside finding 4's verdict: each model's drops, then each policy's trend, described (`worded`:
    with its word, on the accuracy page whose family spends for it)."""
    table = drops(df, gate, level)
    if table.empty:
        return []
    out = [f"across model sizes (the book's reading, not the paper's claim; tasks whose full cache passes on every "
           f"model: {table['tasks'].iloc[0]}; task-average change from each model's full cache): " + "; ".join(
               f"{r.name} {r.policy} at {r.budget:g} {signed_pp(r.drop)} pp, interval {signed_pp(r.high)} to "
               f"{signed_pp(r.low)}" for r in table.itertuples())]
    trends = [t for t in (trend(df, gate, p, level) for p in POLICIES) if t is not None]
    return out + [t.line() if worded else f"{t.described()} (the accuracy chapter's tested trend)" for t in trends]


def carry(df: pd.DataFrame, gate: float, level: float = LEVEL) -> str:
    """What a reader may and may not carry from these rows toward the paper's 8B model, from the trends' words."""
    d = paper_rows(df)
    models = sorted({str(m) for m in d["model"].dropna()}, key=lambda m: parameters(m) or math.inf) \
        if "model" in d else []
    trends = [t for t in (trend(df, gate, p, level) for p in POLICIES) if t is not None]
    if not trends and any(_is_paper_model(m) for m in models):
        return f"These rows read the paper's tasks on its own model, {PAPER_MODEL}: no size is carried across."
    if not trends:
        held = ", ".join(model_name(m) for m in models) or "no recorded model"
        sized = [m for m in models if parameters(m)]
        why = (f"These rows hold the paper's tasks on {held}, but no task's full cache is above chance on every one "
               "of them at the items run, so no trend with model size can be read" if len(sized) >= 2 else
               f"These rows read the paper's tasks on {held} only: nothing here measures how the losses move with "
               "model size")
        return (f"{why}; so the losses' size carries to the paper's {PAPER_MODEL} in neither direction: what carries "
                "is each rule's mechanism (what it keeps, measured as the share attended), not its loss. The "
                "confirmatory profile's size arms measure the trend.")
    largest = max(parameters(m) or 0 for m in models)
    said = "; ".join(t.sentence() for t in trends)
    if all(t.word == NOT_SHOWN for t in trends):
        then = (f"so the losses measured here carry to {PAPER_MODEL} in neither direction, and no trend is extended to "
                "it")
    else:
        then = (f"a trend measured from {trends[0].models[0]} to {trends[0].models[-1]} only: {PAPER_MODEL} is "
                f"{PAPER_PARAMETERS / largest:.1f}x the largest model here, and whether the trend holds that far is "
                "not measured, so a loss here is no bound on 8B's")
    return f"Across {len(trends[0].models)} model sizes, {said}: {then}."


def plot(df: pd.DataFrame, gate: float, level: float = LEVEL):
    """Each policy's task-average score change against the model's parameters (log axis, each model named), one
    panel a budget, its interval as a bar; None where under two models ran."""
    table = drops(df, gate, level)
    if table.empty:
        return None
    set_style()
    palette = policy_colours(POLICIES)
    budgets = [b for b in BUDGETS if np.isclose(table["budget"], b).any()]
    fig, axes = plt.subplots(1, len(budgets), figsize=(max(6 * len(budgets), 11), 4.6), sharey=True, squeeze=False)
    models = table.drop_duplicates("model").sort_values("parameters")
    ticks = [f"{n.removesuffix('-Instruct')}\n{p / 1e9:.2g}B" for n, p in zip(models["name"], models["parameters"])]
    for ax, budget in zip(axes[0], budgets):
        for j, policy in enumerate(POLICIES):
            at = table[(table["policy"] == policy) & np.isclose(table["budget"], budget)]
            x = at["parameters"] * (1 + 0.04 * (j - 0.5))  # side by side at each size
            ax.errorbar(x, -at["drop"] * 100, yerr=[(at["high"] - at["drop"]) * 100, (at["drop"] - at["low"]) * 100],
                        marker="o", capsize=3, color=palette[policy], label=policy)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set(xscale="log", title=f"budget {budget:g}", xlabel="model (parameters)")
        ax.minorticks_off()
        ax.set_xticks(models["parameters"], ticks, fontsize=8)
        ax.set_xlim(models["parameters"].min() / 1.6, models["parameters"].max() * 1.6)
    axes[0][0].set_ylabel("change from the full cache\n(pp, task average)")
    axes[0][-1].legend(fontsize="small")
    measured = df[df["model"].isin(models["model"])] if "model" in df else df
    suptitle(fig, measured, title=f"Across model sizes, protocol one_pass, tasks: {table['tasks'].iloc[0]}\n(the full "
                                  "cache above chance on every model)")
    for text in fig.texts:  # the title names every model and the machine: one line at this width
        text.set_fontsize(9)
    fig.tight_layout(rect=(0, 0, 1, 0.84))
    return fig
