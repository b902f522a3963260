"""A lower bound on a run's time from what the engine counted (kvlib.memory.work) and a machine's limits
(kvlib.hardware): a bound, never an estimate, and said so wherever it is shown.

A phase's time is at least each of: its memory time (weights, KV and selection metadata read, over the memory
bandwidth), its compute time (FLOPs over the peak for the dtype) and its transfers between tiers (bytes over the
link each way plus a floor per transfer; nothing where host and device are one memory, whose reads are already in
the KV read; disk bytes over the disk's bandwidth where it is known). Memory and compute overlap in any kernel, so
they are combined by max; the transfers either overlap them (max) or follow them (sum):

- `bound` (overlapped) is the lower bound of the *mechanism*: a policy whose transfers could overlap its compute
  (InfiniGen's official code prefetches layer i+1 while layer i runs; FlexGen's overlaps loads and stores) is never
  faster than this, however it is implemented.
- `bound_as_scheduled` is the lower bound of *kvlib's* implementation: as SCHEDULES says each policy runs. kvlib's
  InfiniGen serializes (each sparse layer waits for its indices on the host before its gather: the docstring of
  kvlib.policies.infinigen); FlexGen overlaps (kvlib.memory.tiered_kv). Policies that move nothing are the same
  either way. bound_check holds every measured time to this one (at least the overlapped one, then).

A sum over a phase of per-pass maxima is at least the max of the phase's sums, so a bound from a phase's totals is
a bound on the phase (and per step, the phase's bound over its passes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from kvlib.hardware import Spec
from kvlib.memory.work import DIRECTIONS, PHASES, QUANTITIES

OVERLAPPED, SERIALIZED = "overlapped", "serialized"
# How kvlib schedules each policy's transfers against its compute (policies absent move nothing between tiers).
SCHEDULES = {"infinigen": SERIALIZED, "flexgen": OVERLAPPED, "flexgen+h2o": OVERLAPPED, "flexgen_h2o": OVERLAPPED}
LINK_DIRECTIONS = ("host_to_device", "device_to_host")


def phase_times(work: Mapping, spec: Spec, dtype: str | None = None) -> dict:
    """The three floors of a phase's counted work (a mapping of QUANTITIES), in seconds (compute at `dtype`'s peak;
    at the spec's highest where no dtype is named)."""
    read = work["weight_bytes"] + work["kv_read_bytes"] + work["select_read_bytes"]
    flops = work["linear_flops"] + work["attention_flops"] + work["select_flops"]
    return {"memory_s": read / spec.memory_bandwidth.value, "compute_s": flops / spec.peak(dtype),
            "transfer_s": transfer_time(work, spec)}


def transfer_time(work: Mapping, spec: Spec) -> float:
    """The counted crossings over the link and to or from disk: nothing over a unified link, nothing to a disk of
    unknown bandwidth."""
    seconds = 0.0
    if not spec.unified:
        for direction in LINK_DIRECTIONS:
            seconds += work[f"{direction}_bytes"] / spec.link_bandwidth.value
            seconds += work[f"{direction}_transfers"] * spec.link_latency.value
    if spec.disk_bandwidth.value:
        seconds += sum(work[f"{d}_bytes"] for d in DIRECTIONS if "disk" in d) / spec.disk_bandwidth.value
    return seconds


def combine(times: Mapping, schedule: str) -> float:
    kernel = max(times["memory_s"], times["compute_s"])
    if schedule == SERIALIZED:
        return kernel + times["transfer_s"]
    return max(kernel, times["transfer_s"])


def phase_work(stats: Mapping, phase: str) -> dict:
    """One phase's counts from a run's stats (`work_<phase>_<q>`) or a result row (`stat_work_<phase>_<q>`)."""
    out = {}
    for quantity in QUANTITIES:
        for key in (f"work_{phase}_{quantity}", f"stat_work_{phase}_{quantity}"):
            value = stats.get(key)
            if value is not None and not math.isnan(value):  # NaN: a frame's column this row did not have
                out[quantity] = float(value)
                break
        else:
            raise KeyError(f"work_{phase}_{quantity}")
    return out


def phase_bound(stats: Mapping, spec: Spec, phase: str = "decode", policy: str | None = None,
                dtype: str | None = None) -> dict:
    """A phase's bound (seconds, whole phase and per pass), overlapped and as kvlib schedules `policy`, with the
    three floors it comes from."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    work = phase_work(stats, phase)
    times = phase_times(work, spec, dtype)
    bound = combine(times, OVERLAPPED)
    scheduled = combine(times, SCHEDULES.get(policy or "", OVERLAPPED))
    passes = max(work["passes"], 1.0)
    return {**times, "bound_s": bound, "bound_as_scheduled_s": scheduled,
            "bound_per_pass_s": bound / passes, "bound_as_scheduled_per_pass_s": scheduled / passes,
            "schedule": SCHEDULES.get(policy or "", OVERLAPPED), "hardware": spec.name}


def row_dtype(row: Mapping) -> str | None:
    """The dtype a result row ran in, where it says; None (the spec's highest peak: still a bound) otherwise."""
    for key in ("dtype", "stat_dtype"):
        if isinstance(row.get(key), str):
            return row[key].replace("torch.", "")
    return None


def bound_check(rows, spec: Spec | None = None):
    """Measured decode time against the bound, per result row that has work counts (a DataFrame or records):
    runner, batch, measured_decode_s, decode_bound_s ("bound", overlapped), measured / bound, and `holds`: the bound
    as kvlib schedules the policy (at least the overlapped one) is not above the measurement. Rows without counts (older results, outside backends) are left out.

    A notebook calls it over the book's rows with this machine's spec (the default): a row where `holds` is False
    means the spec understates the machine (a figure too low) or the counts overstate the work."""
    import pandas as pd

    from kvlib import hardware

    spec = spec or hardware.load(hardware.THIS_MACHINE)
    frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    out = []
    for _, row in frame.iterrows():
        row = row.to_dict()
        try:
            bound = phase_bound(row, spec, "decode", row.get("policy"), row_dtype(row))
        except KeyError:
            continue
        measured = row.get("decode_s")
        if measured is None or pd.isna(measured) or bound["bound_s"] <= 0:
            continue
        out.append({"runner": row.get("runner", row.get("policy")), "policy": row.get("policy"),
                    "batch_size": row.get("batch_size"), "measured_decode_s": float(measured),
                    "decode_bound_s": bound["bound_s"], "decode_bound_as_scheduled_s": bound["bound_as_scheduled_s"],
                    "bound_limited_by": max(("memory_s", "compute_s", "transfer_s"), key=bound.get)[:-2],
                    "measured_over_bound": float(measured) / bound["bound_s"],
                    "holds": bound["bound_as_scheduled_s"] <= float(measured), "hardware": spec.name})
    return pd.DataFrame(out, columns=["runner", "policy", "batch_size", "measured_decode_s", "decode_bound_s",
                                      "decode_bound_as_scheduled_s", "bound_limited_by", "measured_over_bound",
                                      "holds", "hardware"])
