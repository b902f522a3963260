"""Before a build computes anything: how long its missing units should take on this machine.

Each unit's time on the machine that computed the profile's published reference book (its rows' `unit_compute_s`),
scaled by this machine's probe (kvlib.study.limits) against that machine's. One rate cannot carry it: a decode step at
the book's small batches streams weights (the probe's decode-shaped linears), a prefill is a square matmul, and
machines differ unequally in the two (an AVX2-only CPU is much further behind in the matmul). So the estimate is a
range, the reference's times scaled by the nearer and by the further of the two ratios.

A unit the reference machine ran while other work shared it (`disturbed`) stands in at the undisturbed median of its
experiment's runner; a unit the reference does not hold (a grid changed since) at its runner's median, else its
experiment's; an experiment the reference does not hold is left out and counted. The chapters and the HTML build are
not in it.
"""

from __future__ import annotations

import json
import os
import textwrap
from dataclasses import dataclass

import pandas as pd

from kvlib.study import reference
from kvlib.study.compute_time import unit_times

# the probe's figures a unit's time follows (kvlib.study.limits' keys): higher is faster
RATES = {"decode-shaped linears": ("decode_linears_16_rows", "gflop_per_s"), "matmul": ("matmul_fp32_gflop_per_s",)}


@dataclass(frozen=True)
class Estimate:
    experiment: str
    units: int  # units to compute
    reference_s: float  # their time on the reference machine
    unknown: int  # units without a reference time


def rate(figures: dict, path: tuple[str, ...]) -> float | None:
    for key in path:
        figures = figures.get(key) if isinstance(figures, dict) else None
    return float(figures) if isinstance(figures, (int, float)) else None


def slowdowns(reference_machine: dict, here: dict) -> dict[str, float]:
    """How many times longer each rate makes a unit here than on the reference machine."""
    out = {}
    for name, path in RATES.items():
        there_rate, here_rate = rate(reference_machine, path), rate(here, path)
        if there_rate and here_rate:
            out[name] = there_rate / here_rate
    return out


def unit_seconds(rows: pd.DataFrame) -> dict:
    """The reference time of every (point_hash, repeat), and stand-ins by runner and overall: a unit disturbed there
    is replaced by its runner's undisturbed median."""
    units = unit_times(rows)
    if units.empty:
        return {"units": {}, "runner": {}, "all": None}
    disturbed = rows.drop_duplicates(["point_hash", "repeat"]).set_index(["point_hash", "repeat"]).get("disturbed")
    units["disturbed"] = ([bool(disturbed.get((p, r), False)) for p, r in zip(units.point_hash, units.repeat)]
                          if disturbed is not None else False)
    calm = units[~units.disturbed]
    by_runner = (calm if not calm.empty else units).groupby("runner")["unit_compute_s"].median().to_dict()
    seconds = {(p, r): (by_runner.get(runner, s) if d else s)
               for p, r, runner, s, d in zip(units.point_hash, units.repeat, units.runner, units.unit_compute_s,
                                             units.disturbed)}
    return {"units": seconds, "runner": by_runner, "all": float(units.unit_compute_s.median())}


def seconds_of(known: dict, point, repeat: int) -> float | None:
    """A unit's reference time (unit_seconds' `known`): its own, its other repeats' mean, its runner's median, the
    experiment's; None where the reference has no unit of the experiment."""
    here = known["units"].get((point.key, repeat))
    if here is None:
        same = [s for (p, _), s in known["units"].items() if p == point.key]
        here = sum(same) / len(same) if same else known["runner"].get(point.runner, known["all"])
    return here


def experiment_estimate(experiment: str, todo: list, rows: pd.DataFrame) -> Estimate:
    """todo: (point, repeat) of the units to compute."""
    known = unit_seconds(rows)
    times = [seconds_of(known, point, repeat) for point, repeat in todo]
    return Estimate(experiment, len(todo), sum(t for t in times if t is not None), times.count(None))


def unit_weight(profile: str, experiment: str):
    """A unit's expected time, for dealing units out to workers (kvlib.study.executor.Processes): its reference time
    where the profile has a reference book, else None (every unit alike)."""
    if reference.about(profile) is None:
        return None
    known = unit_seconds(reference.load(profile, experiment))
    if known["all"] is None:
        return None
    return lambda point, repeat: seconds_of(known, point, repeat)


def announce(profile: str, todo: dict[str, list], machine_figures) -> str | None:
    """The estimate in words, one line an experiment; None where the profile has no reference book or nothing is to
    be computed. todo: experiment -> its units to compute; machine_figures: () -> this machine's probe (called only
    when there is an estimate to make: it takes seconds)."""
    about = reference.about(profile)
    machine_path = reference.folder(profile) / "machine.json"
    if about is None or not machine_path.exists() or not any(todo.values()):
        return None
    there = json.loads(machine_path.read_text())
    factors = slowdowns(there, machine_figures())
    if not factors:
        return None
    low, high = min(factors.values()), max(factors.values())
    estimates = [experiment_estimate(e, units, reference.load(profile, e)) for e, units in todo.items() if units]
    minutes = sum(e.reference_s for e in estimates) / 60
    ratios = ", ".join(f"{name} {f:.2f}x" for name, f in factors.items())
    head = (f"{profile}: {sum(e.units for e in estimates)} units to compute, estimated {minutes * low:.0f}-"
             f"{minutes * high:.0f} min here: the reference book's {minutes:.0f} min for them (on "
             f"{there.get('machine_cpu', 'its machine')}) times this machine's probe against its ({ratios} the "
             f"time; its 1-minute load now {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs); chapters and HTML build "
             f"not included")
    lines = textwrap.wrap(head, 100, subsequent_indent="  ")
    for e in estimates:
        m = e.reference_s / 60
        gap = f"; {e.unknown} without a reference time, not counted" if e.unknown else ""
        lines.append(f"  {e.experiment}: {e.units} units, {m * low:.1f}-{m * high:.1f} min{gap}")
    return "\n".join(lines)
