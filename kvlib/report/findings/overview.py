"""The findings page's overview figure: every runner at the book's reference workload as a point of decode throughput
against device memory, coloured by the accuracy it loses, each named beside its point without covering another."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib import colormaps
from matplotlib.colors import Normalize

from kvlib.report.choose.evidence import evidence_for
from kvlib.report.drop_words import signed_pp
from kvlib.report.figure_style import GB, set_style
from kvlib.report.gate import GATE
from kvlib.report.measures import decode_spread
from kvlib.report.provenance import titled
from kvlib.report.study_rows import StudyRows
from kvlib.report.timing_figures import spread_words


def overview(rows: StudyRows, gate: float | None = None):
    """The study's trade-off in one picture: every runner at the book's reference workload (batch scaling's largest
    batch) as a point of decode throughput (geometric mean, bars: its repeats' range) against device memory (its
    measured peak), coloured by the accuracy it loses at its budget there: the paired drop against the full cache on
    the task that decides it (kvlib.report.choose.evidence: the validity gate applied, the nearest scored budget
    below), with its interval beside the name, at the level the title names. The intervals are descriptions, not
    tested statements: no verdict rests on them, so they spend none of the page's error rate and stay at the
    unadjusted level, where the page's claims (and the chooser's answers) are at their families' levels; the title
    says so. Runners that keep and attend every entry lose nothing by construction; a lossy runner with no accuracy
    measured is drawn hollow. Without batch-scaling results there is no workload to draw: a sentence says so and no
    figure comes back (an empty pair of axes would read as a chart of nothing)."""
    batch = rows.batch_scaling
    ok = batch[~batch["oom"].astype(bool)] if not batch.empty else batch
    if ok.empty:
        print("No overview figure: this profile has no batch-scaling results, so no runner has a throughput and "
              "memory to place.")
        return None
    set_style()
    fig, ax = plt.subplots(figsize=(10, 9))
    big = ok[ok["batch_size"] == ok["batch_size"].max()]
    evidence = evidence_for(rows.accuracy, big, gate=GATE if gate is None else gate)
    lossless = set(big.loc[big["lossless"].fillna(False).astype(bool), "policy"]) if "lossless" in big else set()
    norm = Normalize(0, max([5.0] + [max(e.drop.drop * 100 for e in ev) for ev in evidence.values()]))
    cmap = colormaps["viridis_r"]
    points, tasks = [], set()
    for policy, g in big.groupby("policy"):
        spread = decode_spread(g)
        x = g["device_peak_bytes"].median() / GB
        drop, task, detail = _accuracy_lost(policy, g, lossless, evidence)
        if task is not None:
            tasks.add(task)
        colour = "none" if drop is None else cmap(norm(drop))
        below, above = max(0.0, spread.centre - spread.low), max(0.0, spread.high - spread.centre)
        ax.errorbar(x, spread.centre, yerr=[[below], [above]], fmt="none", ecolor="grey", capsize=3, zorder=1)
        ax.scatter(x, spread.centre, s=110, c=[colour] if drop is not None else "none",
                   edgecolors="black", linewidths=1.2, zorder=2)
        points.append((x, spread.centre, policy, detail, task, colour))
    ax.margins(x=0.12, y=0.08)
    bar = fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax)
    bar.set_label("accuracy lost against the full cache (pp)")
    levels = {e.drop.level for ev in evidence.values() for e in ev}
    level = f"its {levels.pop() * 100:g} % interval" if len(levels) == 1 else "its interval"
    title = (f"Throughput, memory and accuracy at batch {int(big['batch_size'].iloc[0])}\n"
             f"geometric mean; {spread_words(big)}\naccuracy: the paired drop"
             + (f" on {next(iter(tasks))}" if len(tasks) == 1 else "") + f" and {level} (described, not tested: "
             "unadjusted)")
    ax.set(xlabel="device memory peak (GiB)", ylabel="decode throughput (tokens/s)",
           title=titled(title, big, rows.accuracy))
    # the name beside each point; its drop and interval in the key below, fastest first (one task decides every
    # drop: named once, in the title)
    key = [plt.Line2D([], [], ls="", marker="o", ms=8, mfc=colour, mec="black",
                      label=f"{policy}: {detail}" + (f" on {task}" if task and len(tasks) > 1 else ""))
           for _, _, policy, detail, task, colour in sorted(points, key=lambda p: -p[1])]
    fig.legend(handles=key, loc="lower center", ncol=1, fontsize="small", frameon=False)  # one column: long keys
    fig.tight_layout(rect=(0, 0.02 + 0.025 * len(key), 1, 1))
    _place_labels(ax, [(x, y, policy) for x, y, policy, *_ in points])
    return fig


def _systems_budget(g: pd.DataFrame) -> str:
    """The budget the point's throughput and memory were measured at, where it is not the accuracy's: said beside
    the accuracy's budget, so that one figure never mixes two budgets silently."""
    budgets = g["budget"].dropna().unique() if "budget" in g else []
    if len(budgets) != 1:
        return ""
    rules = g["budget_rule"].dropna().unique() if "budget_rule" in g else []
    rule = f", {rules[0]} rule" if len(rules) == 1 else ""
    return f"; speed and memory measured at budget {budgets[0]:g}{rule}"


def _accuracy_lost(policy: str, g: pd.DataFrame, lossless: set[str], evidence: dict
                   ) -> tuple[float | None, str | None, str]:
    """The point's colour and words: the accuracy the runner loses in percentage points (None: not measured), the task
    that decides it, and the drop with its interval and budgets as the key says it."""
    if policy in lossless:
        return 0.0, None, "keeps every entry"
    if policy not in evidence:
        return None, None, "accuracy not measured as run here"
    e = max(evidence[policy], key=lambda e: e.drop.high)
    detail = (f"{signed_pp(e.drop.drop)} pp ({signed_pp(e.drop.high)} to {signed_pp(e.drop.low)}) "
              f"at budget {e.budget:g}{_systems_budget(g)}")
    return e.drop.drop * 100, e.task, detail


def _place_labels(ax, labels: list[tuple[float, float, str]]) -> None:
    """Each label beside its point, on whichever side has room, moved up or down by whole lines just enough to cover
    no label placed before it and no point (runners crowd at similar memory and throughput); a moved label keeps a
    thin line to its point, as does one on the point's left. Boxes are the texts' drawn extents, so the rule holds at
    any font size."""
    fig = ax.figure
    fig.canvas.draw()  # the limits and the renderer the labels are measured with
    renderer, to_pixels = fig.canvas.get_renderer(), ax.transData.transform
    pt = 72 / fig.dpi  # offsets in points: the same at any saved resolution
    frame = ax.get_window_extent(renderer)
    dots = [to_pixels((x, y)) for x, y, _ in labels]
    radius = 8.0  # a marker's drawn radius in pixels (s=110 points^2), with a margin

    def cost(box) -> float:
        """Pixels of overlap with what is already drawn, plus whatever leaves the axes."""
        inside = (max(0.0, frame.x0 - box.x0) + max(0.0, box.x1 - frame.x1) + max(0.0, frame.y0 - box.y0)
                  + max(0.0, box.y1 - frame.y1)) * box.height
        labels_hit = sum(max(0.0, min(box.x1, b.x1) - max(box.x0, b.x0))
                         * max(0.0, min(box.y1, b.y1) - max(box.y0, b.y0)) for b in placed)
        dots_hit = sum(1.0 for dx, dy in dots
                       if box.x0 - radius < dx < box.x1 + radius and box.y0 - radius < dy < box.y1 + radius)
        return inside + labels_hit + dots_hit * radius**2

    placed = []
    for x, y, text in sorted(labels, key=lambda p: -p[1]):
        note = ax.annotate(text, (x, y), xytext=(0, 0), textcoords="offset points", fontsize="small", va="bottom")
        line = note.get_window_extent(renderer).height / pt * 1.1
        best = None
        for k in range(16):  # whole lines away, nearest first: right above, right below, left above, left below
            for side, sign in ((1, 1), (1, -1), (-1, 1), (-1, -1)) if k else ((1, 1), (-1, 1)):
                dy = 3 + line * k * sign
                note.set_position((14 * side, dy))
                note.set_horizontalalignment("left" if side > 0 else "right")
                box = note.get_window_extent(renderer)
                c = cost(box)
                if best is None or c < best[0]:
                    best = (c, side, dy, box)
            if best[0] == 0:
                break
        _, side, dy, box = best
        note.remove()
        ax.annotate(text, (x, y), xytext=(14 * side, dy), textcoords="offset points", fontsize="small",
                    ha="left" if side > 0 else "right", va="bottom",
                    arrowprops=None if (side, dy) == (1, 3) else {"arrowstyle": "-", "color": "grey", "lw": 0.6})
        placed.append(box)
