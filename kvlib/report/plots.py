"""Figures of the book, drawn from results frames (kvlib.study.results.load), so notebook cells stay one line."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from kvlib.report.tables import decode_spread, geometric_mean

GB = 2**30
COMPONENTS = ["weights", "weights_packed", "activations", "kv", "kv_reserved", "overhead"]


def _style():
    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")


def _palette(policies) -> dict:
    """One colour per policy, the same in every panel of a figure (colorblind-safe up to its 10 colours, then evenly
    spaced hues: no two runners share one)."""
    names = sorted(set(policies))
    return dict(zip(names, sns.color_palette("colorblind" if len(names) <= 10 else "husl", len(names))))


def ttft(df: pd.DataFrame):
    """TTFT vs prompt length, one line per policy and prefill mode (geometric mean of the repeats, the band their
    range); OOM points marked on the top edge."""
    _style()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ok = df[~df["oom"]]
    sns.lineplot(ok, x="prompt_tokens", y="ttft_s", hue="policy", style="prefill", markers=True, dashes=True,
                 estimator=geometric_mean, errorbar=("pi", 100), ax=ax)
    oom = df[df["oom"]]
    if not oom.empty:
        top = ok["ttft_s"].max() * 1.3 if not ok.empty else 1
        ax.scatter(oom["prompt_tokens"], [top] * len(oom), marker="x", color="crimson", s=80, label="OOM")
        ax.axhline(top, color="crimson", lw=0.5, ls=":")
    ax.set(xscale="log", yscale="log", xlabel="prompt length (tokens)", ylabel="time to first token (s)",
           title="TTFT vs prompt length (geometric mean, band: range of repeats; x = out of device memory)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    fig.tight_layout()
    return fig


def memory_components(df: pd.DataFrame, by: str, tier: str = "device", title: str = ""):
    """Peak memory by component, stacked, one bar per (policy, `by`) value.

    The weights are the same for every policy and would dwarf the rest: they are left out and named in the title.
    """
    _style()
    cols = [f"{tier}_{c}_peak_bytes" for c in COMPONENTS if c != "weights" and f"{tier}_{c}_peak_bytes" in df]
    done = df[~df["oom"]]
    data = done.groupby(["policy", by])[cols].max() / GB
    data.columns = [c.removeprefix(f"{tier}_").removesuffix("_peak_bytes") for c in cols]
    data = data.loc[:, (data > 0).any()]
    weights = done.get(f"{tier}_weights_peak_bytes", pd.Series([0])).max() / GB
    fig, ax = plt.subplots(figsize=(9, 4.5))
    data.plot.bar(stacked=True, ax=ax, width=0.8)
    note = f" (weights, {weights:.2f} GiB for every policy, not shown)" if weights else ""
    ax.set(xlabel=f"policy, {by.replace('_', ' ')}", ylabel=f"{tier} memory, GiB (peak per component)",
           title=(title or f"{tier.capitalize()} memory by component") + note)
    ax.legend(title="component", fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    plt.setp(ax.get_xticklabels(), rotation=45, ha="right")
    fig.tight_layout()
    return fig


def batch_scaling(df: pd.DataFrame):
    """Decode throughput, throughput per GiB of device memory, device and host peak memory vs batch size."""
    _style()
    d = df[~df["oom"]].copy()
    d["throughput_per_gib"] = d["decode_tokens_per_s"] / (d["device_peak_bytes"] / GB)
    d["device_peak_gib"] = d["device_peak_bytes"] / GB
    d["host_peak_gib"] = d["host_peak_bytes"] / GB
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [("decode_tokens_per_s", "decode throughput (tokens/s)"),
              ("throughput_per_gib", "throughput per GiB of device memory"),
              ("device_peak_gib", "device memory peak (GiB)"), ("host_peak_gib", "host (offload) memory peak (GiB)")]
    for ax, (col, label) in zip(axes.flat, panels):
        if col == "decode_tokens_per_s":
            throughput(d, "batch_size", ax, legend=False)
        else:
            sns.lineplot(d, x="batch_size", y=col, hue="policy", palette=_palette(d["policy"]), marker="o",
                         estimator=geometric_mean, errorbar=None, ax=ax, legend=False)
        ax.set(xlabel="batch size", ylabel=label)
    fig.suptitle("Batch scaling (mixed-length prompts; geometric mean of repeats, bars: range of repeats and their "
                 "steps)")
    fig.tight_layout()
    # one legend beside the four panels: inside one, eleven runners covered its lines
    fig.legend(*axes.flat[0].get_legend_handles_labels(), loc="upper left", bbox_to_anchor=(1.0, 0.93),
               fontsize="small")
    return fig


def throughput(d: pd.DataFrame, by: str, ax, legend: bool = True) -> None:
    """Decode throughput vs `by`, one line per policy: the geometric mean over repeats, error bars spanning the repeats
    and each repeat's interquartile range of per-step throughput (kvlib.report.tables.decode_spread, as the findings
    read it)."""
    palette = _palette(d["policy"])
    for policy, g in d.groupby("policy"):
        spreads = [(x, decode_spread(point)) for x, point in g.groupby(by)]
        xs, centres = [x for x, _ in spreads], [s.centre for _, s in spreads]
        # max(0, .): a single repeat's geometric mean, exp(log(x)), may round a hair past x
        yerr = [[max(0.0, s.centre - s.low) for _, s in spreads], [max(0.0, s.high - s.centre) for _, s in spreads]]
        ax.errorbar(xs, centres, yerr=yerr, marker="o", capsize=3, label=policy, color=palette[policy])
    if legend:  # beside the axes: inside, a legend of every runner covers the lines
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))


def wall_split(df: pd.DataFrame, by: str, title: str = ""):
    """Wall time split into prefill compute / cache operations / decode compute / other, stacked, per (policy, `by`);
    cache operations as book/methods.md defines them (kvlib.engine.run_result.CACHE_OPS)."""
    _style()
    cols = [c for c in ("split_prefill_s", "split_cache_ops_s", "split_decode_s", "split_other_s") if c in df]
    data = df[~df["oom"]].groupby(["policy", by])[cols].median()
    data.columns = [c.removeprefix("split_").removesuffix("_s").replace("_", " ").replace("cache ops",
                                                                                          "cache operations")
                    for c in cols]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    data.plot.bar(stacked=True, ax=ax, width=0.8)
    ax.set(xlabel=f"policy, {by.replace('_', ' ')}", ylabel="wall time (s)", title=title or "Wall-time split")
    ax.legend(fontsize="small")
    plt.setp(ax.get_xticklabels(), rotation=45, ha="right")
    fig.tight_layout()
    return fig


def decode_length(df: pd.DataFrame):
    _style()
    fig, ax = plt.subplots(figsize=(7, 4))
    throughput(df[~df["oom"]], "output_tokens", ax)
    ax.set(xlabel="output length (tokens)", ylabel="decode throughput (tokens/s)",
           title="Decode throughput vs output length (geometric mean, bars: range of repeats and their steps)")
    return fig


def accuracy(table: pd.DataFrame):
    """Paper Fig. 7: one panel per task, score against the KV share each policy actually attended (its configured
    budget as the point's marker), 95 % intervals as bars, the full cache as a dashed line with its band; the key below
    the panels (eleven policies' names written beside their points covered each other)."""
    _style()
    tasks = sorted(table["task"].unique())
    fig, axes = plt.subplots(1, len(tasks), figsize=(max(9.0, 5.5 * len(tasks)), 6), squeeze=False)
    palette = _palette(table["policy"])
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
    fig.legend(handles=key, loc="lower center", ncol=columns, fontsize="small", frameon=False)
    fig.tight_layout(rect=(0, 0.03 + 0.04 * -(-len(key) // columns), 1, 1))
    return fig


def recall_by_length(df: pd.DataFrame):
    """Recall accuracy vs context length, one panel per budget (the full cache in each)."""
    _style()
    d = df[df["task"] == "kvlib_recall"].copy()
    full = d[d["policy"] == "full"]
    budgets = sorted(d["budget"].dropna().unique())
    fig, axes = plt.subplots(1, len(budgets), figsize=(4 * len(budgets), 3.6), sharey=True, squeeze=False)
    for ax, budget in zip(axes.flat, budgets):
        panel = pd.concat([full, d[d["budget"] == budget]])
        sns.lineplot(panel, x="length", y="correct", hue="policy", palette=_palette(d["policy"]), marker="o",
                     errorbar=None, ax=ax,
                     legend=ax is axes.flat[-1])
        ax.set(xscale="log", xlabel="context length (tokens)", ylabel="recall accuracy", title=f"budget {budget:g}")
    fig.tight_layout()
    return fig


def retention(df: pd.DataFrame):
    """Paper Fig. 8: (a) share of correct answers by context bucket, (b) by turn, the band spanning the buckets; one
    row of the two per protocol the rows ran under (two measurements, read apart)."""
    _style()
    protocols = sorted(df["protocol"].dropna().unique()) if "protocol" in df else []
    fig, axes = plt.subplots(max(1, len(protocols)), 2, figsize=(11, 4 * max(1, len(protocols))), squeeze=False)
    order = sorted(df["bucket"].unique(), key=lambda label: df.loc[df["bucket"] == label, "context_tokens"].min())
    palette = _palette(df["policy"])
    for (a, b), protocol in zip(axes, protocols or [None]):
        d = df if protocol is None else df[df["protocol"] == protocol]
        named = f", {protocol}" if len(protocols) > 1 else ""
        sns.barplot(d, x="bucket", y="correct", hue="policy", palette=palette, order=order, errorbar=("ci", 95),
                    seed=0, ax=a, legend=False)
        a.set(xlabel="conversation length bucket (tokens)", ylabel="retention accuracy",
              title=f"(a) by context length{named} (bars: 95 % bootstrap interval)")
        per_bucket = d.groupby(["policy", "bucket", "turn"], as_index=False)["correct"].mean()
        sns.lineplot(per_bucket, x="turn", y="correct", hue="policy", palette=palette, marker="o",
                     errorbar=("pi", 100), ax=b)
        b.set(xlabel="turn at which the question is asked", ylabel="retention accuracy",
              title=f"(b) by turn{named} (band: range over buckets)")
        b.legend(title="policy", fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))  # inside, it hid lines
    fig.tight_layout()
    return fig


def ruler(table: pd.DataFrame, task: str = "mean"):
    """RULER score vs KV budget, one line per policy, one panel per length (kvlib.report.tables.ruler_table; `task`: one
    subtask or `mean`, the mean over the subtasks); bars: 95 % bootstrap interval over the items; the full cache as a
    dashed line with its band."""
    _style()
    t = table[table["task"] == task]
    lengths = sorted(t["length"].unique())
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 3.8), sharey=True, squeeze=False)
    palette = _palette(table["policy"])
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
    fig.suptitle(f"RULER {'mean over subtasks' if task == 'mean' else task} vs KV budget (bars: 95 % interval)")
    fig.tight_layout()
    return fig


def overview(frames: dict[str, pd.DataFrame], gate: float | None = None):
    """The study's trade-off in one picture: every runner at the book's reference workload (batch scaling's largest
    batch) as a point of decode throughput (geometric mean, bars: its repeats' range) against device memory (its
    measured peak), coloured by the accuracy it loses at its budget there: the paired drop against the full cache on
    the task that decides it (kvlib.report.choose.evidence: the validity gate applied, the nearest scored budget
    below), with its 95 % interval beside the name. Runners that keep and attend every entry lose nothing by
    construction; a lossy runner with no accuracy measured is drawn hollow."""
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    from kvlib.report.accuracy_lines import signed_pp
    from kvlib.report.choose.evidence import evidence_for
    from kvlib.report.gate import GATE

    _style()
    batch = frames.get("batch_scaling", pd.DataFrame())
    fig, ax = plt.subplots(figsize=(10, 9))
    ok = batch[~batch["oom"].astype(bool)] if not batch.empty else batch
    if ok.empty:
        ax.text(0.5, 0.5, "no batch-scaling results in this profile", ha="center", transform=ax.transAxes)
        return fig
    big = ok[ok["batch_size"] == ok["batch_size"].max()]
    evidence = evidence_for(frames.get("accuracy", pd.DataFrame()), big, gate=GATE if gate is None else gate)
    lossless = set(big.loc[big["lossless"].fillna(False).astype(bool), "policy"]) if "lossless" in big else set()
    norm = Normalize(0, max([5.0] + [max(e.drop.drop * 100 for e in ev) for ev in evidence.values()]))
    cmap = colormaps["viridis_r"]
    points, tasks = [], set()
    for policy, g in big.groupby("policy"):
        spread = decode_spread(g)
        x = g["device_peak_bytes"].median() / GB
        task = None
        if policy in lossless:
            drop, detail = 0.0, "keeps every entry"
        elif policy in evidence:
            e = max(evidence[policy], key=lambda e: e.drop.high)
            drop, task = e.drop.drop * 100, e.task
            tasks.add(task)
            detail = (f"{signed_pp(e.drop.drop)} pp ({signed_pp(e.drop.high)} to {signed_pp(e.drop.low)}) "
                      f"at budget {e.budget:g}{_systems_budget(g)}")
        else:
            drop, detail = None, "accuracy not measured as run here"
        colour = "none" if drop is None else cmap(norm(drop))
        below, above = max(0.0, spread.centre - spread.low), max(0.0, spread.high - spread.centre)
        ax.errorbar(x, spread.centre, yerr=[[below], [above]], fmt="none", ecolor="grey", capsize=3, zorder=1)
        ax.scatter(x, spread.centre, s=110, c=[colour] if drop is not None else "none",
                   edgecolors="black", linewidths=1.2, zorder=2)
        points.append((x, spread.centre, policy, detail, task, colour))
    ax.margins(x=0.12, y=0.08)
    bar = fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax)
    bar.set_label("accuracy lost against the full cache (pp)")
    ax.set(xlabel="device memory peak (GiB)", ylabel="decode throughput (tokens/s)",
           title=f"Throughput, memory and accuracy at batch {int(big['batch_size'].iloc[0])}\n"
                 f"geometric mean; bars: range of repeats and steps\naccuracy: the paired drop"
                 + (f" on {next(iter(tasks))}" if len(tasks) == 1 else "") + " and its 95 % interval")
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
