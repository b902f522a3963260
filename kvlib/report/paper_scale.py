"""The chapter "At the paper's scale (projected)": this machine's measured decode against its bound, the specs the
projections read, and the paper's GPU settings projected (kvlib.projection). Every figure of the projection says
"projected"; only the measured/bound table holds a measurement, its bound read against this machine's limits as
measured before its rows were timed (results/<profile>/machine.json)."""

from __future__ import annotations

import pandas as pd

from kvlib.report.bounds import measured_over_bound
from kvlib.report.measures import outside_label


def this_machine(profile: str):
    """The spec of the machine that timed the profile's rows, or None where none was recorded."""
    from kvlib import hardware
    from kvlib.paths import read_from

    path = read_from(profile) / "machine.json"
    return hardware.this_machine(path) if path.is_file() else None


def machine_text(profile: str, df: pd.DataFrame) -> str:
    """What the bound is read against: the recorded limits and whether they are of the machine that timed the rows."""
    spec = this_machine(profile)
    if spec is None:
        return (f"No limits recorded for this profile's machine (results/{profile}/machine.json): `kvlib study` "
                f"records them before it times anything. No bound is read.")
    cpu = spec.extra.get("machine_cpu")
    timed = sorted(set(df.get("machine_cpu", pd.Series(dtype=object)).dropna()))
    same = cpu is not None and timed == [cpu]
    return (f"The bound is read against this machine's limits as measured before its rows were timed "
            f"({cpu or 'an unnamed CPU'}: memory read {spec.memory_bandwidth.value / 1e9:.1f} GB/s, "
            f"{spec.peak(None) / 1e9:.0f} GFLOP/s fp32, host and device one memory)"
            + ("." if same else f"; the rows were timed on {', '.join(timed) or 'an unnamed machine'}: "
               f"the bound may not be theirs."))


def gauge(df: pd.DataFrame, profile: str, batches=(1, 16)) -> pd.DataFrame:
    """Measured / bound per runner at the given batch sizes (every batch where none of them ran)."""
    spec = this_machine(profile)
    if spec is None or df.empty:
        return pd.DataFrame()
    d = df[df["batch_size"].isin(batches)] if df["batch_size"].isin(batches).any() else df
    return measured_over_bound(d, spec)


def gauge_text(table: pd.DataFrame, df: pd.DataFrame) -> str:
    """The spread of measured / bound, per batch size, and whether every bound held: read from the table."""
    if table.empty:
        return "No rows with counted work: the bound cannot be read (results from before kvlib counted work)."
    parts = [f"at batch {b}: {g['measured_over_bound'].min():.1f}-{g['measured_over_bound'].max():.1f}x their bound"
             for b, g in table.groupby("batch_size")]
    broken = table[~table["held_every_repeat"]]
    held = ("every measured decode was at least its bound" if broken.empty else
            f"the bound was above a measurement for {', '.join(sorted(set(broken['runner'])))}: a limit understated "
            f"or work overcounted, to be explained")
    outside = outside_label(df)
    borrowed = f"; {outside}'s bound is full's counted work (it counts nothing from inside)" if outside else ""
    return f"Measured decode time over its bound (median of the repeats), {'; '.join(parts)}; {held}{borrowed}."


def figure(table: pd.DataFrame, column: str = "decode_tokens_per_s_projected"):
    """Projected decode throughput against batch size, one panel per hardware, every runner a line: the chapter's
    one figure, labelled projected."""
    import matplotlib.pyplot as plt

    from kvlib.projection import paper_scale as projection

    rows = table[table["setting"] == "batch scaling"]
    if column not in rows or rows[column].isna().all():
        column = "decode_tokens_per_s_bound_projected"
    names = list(dict.fromkeys(rows["hardware"]))
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), sharey=True, squeeze=False)
    for ax, name in zip(axes[0], names):
        for runner, g in rows[rows["hardware"] == name].groupby("runner", sort=False):
            ax.plot(g["batch_size"], g[column], marker="o", label=runner)
        ax.set(title=f"{name}: projected", xlabel="batch size", yscale="log")
    axes[0][0].set_ylabel(f"decode tokens/s, projected ({'bound' if 'bound' in column else 'aiconfigurator'})")
    axes[0][-1].legend(fontsize=8)
    low, high = projection.PROMPT_RANGE
    fig.suptitle(f"{projection.MODEL}, bf16, prompts {low:,}-{high:,} tokens, {projection.BATCH_OUTPUT} new tokens: "
                 f"PROJECTED, not measured")
    fig.tight_layout()
    return fig


GAUGE_COLUMNS = {"runner": "runner", "batch_size": "batch", "measured_decode_s": "measured decode (s)",
                 "decode_bound_s": "bound, overlapped (s)", "bound_as_scheduled_s": "bound as kvlib schedules it (s)",
                 "limited_by": "bound set by", "measured_over_bound": "measured / bound",
                 "held_every_repeat": "bound held in every repeat", "repeats": "repeats", "counts": "work counts"}


def gauge_table(table: pd.DataFrame):
    """The gauge for the page: named columns with units, no index (what gauge_text summarises)."""
    if table.empty:
        return table
    out = table[[c for c in GAUGE_COLUMNS if c in table]].rename(columns=GAUGE_COLUMNS)
    return out.style.hide(axis="index").format(precision=3, na_rep="-")


# A spec's figures in the units a reader knows: (divide by, unit).
UNITS = {"memory_bandwidth": (1e12, "TB/s"), "device_memory": (1e9, "GB"), "disk_bandwidth": (1e9, "GB/s"),
         "link.bandwidth": (1e9, "GB/s each way"), "link.latency": (1e-6, "us a copy")}


def spec_summary(names=None):
    """One row a shipped machine: the figures a projection reads, in their units (their sources: spec_sources)."""
    from kvlib import hardware

    rows = []
    for name in names or [n for n in hardware.names() if n != hardware.THIS_MACHINE]:
        spec = hardware.load(name)
        rows.append({"machine": spec.description, "memory bandwidth (TB/s)": spec.memory_bandwidth.value / 1e12,
                     "bf16 peak, dense (TFLOP/s)": spec.peak("bfloat16") / 1e12,
                     "device memory (GB)": spec.device_memory.value / 1e9,
                     "host link (GB/s each way)": None if spec.unified else spec.link_bandwidth.value / 1e9,
                     "measured kernel tables": spec.kernel_system or "none"})
    return pd.DataFrame(rows).style.hide(axis="index").format(precision=2, na_rep="unified")


def spec_sources(names=None):
    """Every figure of every shipped spec with its unit and source: the chapter's appendix."""
    from kvlib import hardware

    rows = []
    for name in names or [n for n in hardware.names() if n != hardware.THIS_MACHINE]:
        for figure, fig in hardware.load(name).figures().items():
            scale, unit = UNITS.get(figure, (1e12, "TFLOP/s") if figure.startswith("peak_flops") else (1, ""))
            rows.append({"machine": name, "figure": figure.replace("_", " ").replace(".", ", "),
                         "value": None if fig.value is None else fig.value / scale, "unit": unit,
                         "source": fig.source})
    return pd.DataFrame(rows).style.hide(axis="index").format(precision=3, na_rep="-")


def decomposition_table(frame: pd.DataFrame, cases=None):
    """The decomposition for the page: terms as rows, the given cases (every one by default) in ms a step, the
    residual's row shaded so it is never lost among the terms."""
    from kvlib.projection.decomposition import RESIDUAL

    keep = ["term", "kind", "basis"] + [c for c in frame.columns[3:] if cases is None or c in cases]
    def shade(row):
        return ["font-weight: bold; background-color: #fff3cd" if row["term"] == RESIDUAL else ""] * len(row)

    return frame[keep].style.hide(axis="index").format(precision=1, na_rep="not known").apply(shade, axis=1)


def h2o_table(frame: pd.DataFrame):
    """The paper's H2O beside the projection, for the page: no index, the gap's words wrapped."""
    return frame.style.hide(axis="index").set_properties(subset=["the gap"], **{"white-space": "normal"})


FIGURE_NAMES = {"vllm_memory": "vLLM's device memory", "h2o_memory": "H2O's device memory",
                "infinigen_host": "InfiniGen's host memory", "batch_gap": "the gap at batch scaling",
                "length_gap": "the gap at decode length", "infinigen_rate": "InfiniGen's decode rate",
                "minutes": "decode time at the longest output"}


def paper_figures_table(frame: pd.DataFrame):
    """The paper's figures beside the projection, for the page: each figure named in words, no index, the one
    machine said in the caption."""
    out = frame.assign(figure=frame["figure"].map(FIGURE_NAMES).fillna(frame["figure"])).drop(columns="hardware")
    machine = ", ".join(sorted(set(frame["hardware"])))
    return (out.style.hide(axis="index").format(na_rep="-").set_caption(f"projected on {machine}")
            .set_properties(**{"white-space": "normal", "text-align": "left"}))
