"""The chapter "At the paper's scale (projected)": this machine's measured decode against its bound, the specs the
projections read, and the paper's GPU settings projected (kvlib.projection). Every figure of the projection says
"projected"; only the measured/bound table holds a measurement, its bound read against this machine's limits as
measured before its rows were timed (results/<profile>/machine.json)."""

from __future__ import annotations

import pandas as pd

from kvlib.report.bounds import measured_over_bound
from kvlib.report.tables import outside_label


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
