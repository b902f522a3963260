"""Serving: which runners meet an SLO at a request rate, read from the serving results by the chooser's rules, with
the accuracy each loses (kvlib.study.experiments.serving)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from kvlib.report.choose.evidence import WITHIN, evidence_for, judge_accuracy
from kvlib.report.choose.workload import Estimate, lossless_runners, read_at
from kvlib.report.gate import GATE
from kvlib.report.pages import SERVING

SERVING_PERCENTILE = "p90"  # a runner meets a limit at a rate where 90 % of its requests are within it


_LIMIT_NAMES = {"ttft_s": "TTFT", "tpot_s": "TPOT"}


@dataclass
class ServingChoice:
    """Which runners meet the SLO at a request rate, from the serving results, and the accuracy each loses."""

    rate: float
    slo: dict[str, float]  # ttft_s, tpot_s
    capacity_gb: float | None = None  # the device capacity the serving results read were measured at
    meets: dict[str, dict[str, Estimate]] = field(default_factory=dict)  # runner -> {"ttft_s": .., "tpot_s": ..}
    misses: dict[str, str] = field(default_factory=dict)  # runner -> which limit it misses, with the figure
    excluded: dict[str, str] = field(default_factory=dict)  # runner -> why it was not read (memory, accuracy, rate)
    accuracy: dict[str, str] = field(default_factory=dict)  # runner -> the accuracy it loses, as read
    notes: list[str] = field(default_factory=list)
    error_rate: str = ""  # what the accuracy intervals read spend together (kvlib.report.pages.SERVING)

    def text(self) -> str:
        limits = " and ".join(f"{SERVING_PERCENTILE} {name} <= {self.slo[key]:g} s"
                              for key, name in _LIMIT_NAMES.items() if key in self.slo)
        where = "no configured device capacity" if self.capacity_gb is None else f"{self.capacity_gb:g} GiB"
        lines = [f"At {self.rate:g} requests/s with {limits or 'no SLO given'} (serving results at {where}):"]
        if self.meets:
            ranked = sorted(self.meets.items(), key=lambda kv: [e.value for e in kv[1].values()])
            lines.append("Meet it: " + "; ".join(f"{p} ({self._figures(got)}{self._accuracy(p)})"
                                                 for p, got in ranked) + ".")
        else:
            lines.append("No runner measured meets it.")
        lines += [f"Misses it: {p}: {why}{self._accuracy(p)}." for p, why in sorted(self.misses.items())]
        lines += [f"Not read: {p}: {why}." for p, why in sorted(self.excluded.items())]
        return "\n".join(lines + self.notes + ([self.error_rate] if self.error_rate else []))

    def _accuracy(self, policy: str) -> str:
        return f"; {self.accuracy[policy]}" if policy in self.accuracy else ""

    @staticmethod
    def _figures(got: dict[str, Estimate]) -> str:
        return ", ".join(f"{SERVING_PERCENTILE} {_LIMIT_NAMES[k]} {e.how('s')}" for k, e in got.items())


def choose_serving(serving: pd.DataFrame, accuracy: pd.DataFrame, rate: float, slo_ttft_s: float | None = None,
                   slo_tpot_s: float | None = None, max_accuracy_drop: float | None = None,
                   device_memory_gb: float | None = None, gate: float = GATE) -> ServingChoice:
    """Which runners meet the SLO (their p90 TTFT and p90 TPOT within the limits given) at `rate`, read from the
    serving results by the chooser's rules: measured at the rate, or interpolated between the two measured rates
    around it; below the grid's lowest rate, its lowest rate is read (latency does not fall as the load rises) and
    the answer says so; above its highest, nothing is read (never extrapolated). Memory: the results measured at the
    largest capacity that is no larger than `device_memory_gb` (a larger memory only adds blocks); none such, no
    answer. Accuracy as in `choose`: the largest plausible loss against the full cache, lossless runners none."""
    slo = {k: v for k, v in (("ttft_s", slo_ttft_s), ("tpot_s", slo_tpot_s)) if v is not None}
    choice = ServingChoice(rate, slo)
    if serving.empty:
        choice.notes.append("No serving results in this profile: `kvlib study --experiments serving` computes them.")
        return choice
    d = _at_capacity(serving.assign(oom=serving["oom"].fillna(False).astype(bool)), device_memory_gb, choice)
    if d is None:
        return choice
    _weigh_accuracy(choice, d, accuracy, max_accuracy_drop, gate)
    rates = sorted(d["request_rate"].unique())
    if rate < rates[0]:
        choice.notes.append(f"{rate:g} requests/s is below the lowest rate measured; read at {rates[0]:.3g} requests/s "
                            f"(latency at a lower load is no higher).")
    for p, g in d.groupby("policy"):
        if p not in choice.excluded:
            _read_runner(choice, p, g, rate, slo)
    if not slo:
        choice.notes.append("No SLO given (--slo-ttft, --slo-tpot): every runner measured at this rate meets it.")
    return choice


def _at_capacity(d: pd.DataFrame, device_memory_gb: float | None, choice: ServingChoice) -> pd.DataFrame | None:
    """The rows measured at the largest capacity within `device_memory_gb` (none asked: the largest measured), the
    capacity noted on the choice; None, with a note, where every measured capacity is larger than the memory asked."""
    capacities = d["device_capacity_gb"].dropna().unique() if "device_capacity_gb" in d else []
    if device_memory_gb is not None:
        fitting = sorted(c for c in capacities if c <= device_memory_gb + 1e-12)
        if not fitting:
            measured = ", ".join(f"{c:g}" for c in sorted(capacities)) or "no configured capacity"
            choice.notes.append(f"Serving was measured at {measured} GiB, none of it within the {device_memory_gb:g} "
                                f"GiB asked: no answer (less memory means fewer blocks; not extrapolated).")
            return None
        choice.capacity_gb = float(fitting[-1])
        return d[d["device_capacity_gb"] == fitting[-1]]
    if len(capacities):
        choice.capacity_gb = float(max(capacities))
        return d[d["device_capacity_gb"] == max(capacities)]
    return d


def _weigh_accuracy(choice: ServingChoice, d: pd.DataFrame, accuracy: pd.DataFrame, max_accuracy_drop: float | None,
                    gate: float) -> None:
    """Each runner's accuracy as `choose` weighs it: the loss it shows, or, against a tolerance, excluded beyond it."""
    lossless = lossless_runners(d)
    evidence = evidence_for(accuracy, d, gate=gate, page=SERVING)
    if evidence:
        level = next(iter(evidence.values()))[0].drop.level
        choice.error_rate = (f"Error rate: the accuracy intervals read here, each at {level:.2%}, are wrong together "
                             f"with a chance of at most {SERVING.alpha:.0%} (kvlib.report.pages.SERVING).")
    for p in sorted(d["policy"].unique()):
        if p in lossless:
            choice.accuracy[p] = "keeps every entry: no accuracy lost"
        elif p in evidence:
            if max_accuracy_drop is None:
                e = max(evidence[p], key=lambda e: e.drop.high)
                choice.accuracy[p] = f"accuracy: {e.text()}"
                continue
            e = judge_accuracy(evidence[p], max_accuracy_drop)
            if e.outcome == WITHIN:
                choice.accuracy[p] = f"accuracy within {max_accuracy_drop:g} pp: {e.text()}"
            else:
                choice.excluded[p] = e.text(max_accuracy_drop)
        elif max_accuracy_drop is not None:
            choice.excluded[p] = "its accuracy was not measured in this profile on a task the full cache passes"
        else:  # a lossy runner with no accuracy read says so rather than nothing
            choice.accuracy[p] = "its accuracy loss was not measured in this profile"


def _read_runner(choice: ServingChoice, p: str, g: pd.DataFrame, rate: float, slo: dict[str, float]) -> None:
    """One runner's p90 latencies read at `rate` against each limit: it meets the SLO, misses it (saying which
    limit), or is excluded (measured only below the rate, or out of memory at or below the rate it is read at)."""
    measured = sorted(g["request_rate"].unique())
    if rate > measured[-1]:
        choice.excluded[p] = f"measured only up to {measured[-1]:.3g} requests/s (not extrapolated)"
        return
    at = max(rate, measured[0])
    read_up_to = min(x for x in measured if x >= at)  # the highest rate a reading at `at` rests on
    if g.loc[g["oom"], "request_rate"].le(read_up_to).any():
        choice.excluded[p] = f"ran out of device memory at or below {read_up_to:.3g} requests/s"
        return
    got, missed = {}, []
    for key, limit in slo.items():
        curve = g[~g["oom"]].groupby("request_rate")[f"{key}_{SERVING_PERCENTILE}"].median()
        estimate = read_at(curve, at, "rate")
        if estimate is None:
            missed.append(f"no {key} measured")
            continue
        got[key] = estimate
        if estimate.value > limit:
            missed.append(f"{SERVING_PERCENTILE} {_LIMIT_NAMES[key]} {estimate.how('s')} > {limit:g} s")
    if missed:
        choice.misses[p] = "; ".join(missed)
    else:
        choice.meets[p] = got
