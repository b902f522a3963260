"""What an experiment declares, once, in its own module (kvlib.study.experiments.<name>), and the registry every other
part of the study queries instead of keeping a list of names: the profile's schema and guide, the executor, the book's
chapters, random weights' limits, the chooser's runners.

    EXPERIMENT = register(Experiment(name="ttft", title="Time to first token", run_point=run_point, timed=True,
                                     workload={"prompt_tokens": positive_int}, required=("prompt_tokens",)))

The registry is filled by importing kvlib.study.experiments (its package imports every module, in the book's order);
it holds declarations only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd

from kvlib.errors import UserError
from kvlib.models.random_weights import CAVEAT
from kvlib.report.opening import opening
from kvlib.study.checks import Check


@dataclass(frozen=True)
class Experiment:
    name: str  # the profile's key, the results folder's and the chapter's name
    title: str
    # (Point, Kept) -> list[dict]: the point's result rows, from what the executor's process keeps (kvlib.study.kept)
    run_point: Callable
    # what it measures is time: a run disturbed by other processes is measured again, and its units run alone;
    # else a score, the same under load: never measured again, its units may share the cores (executor.Processes)
    timed: bool
    workload: dict[str, Check] = field(default_factory=dict)  # its workload values and their checks (schema)
    # the values it cannot run without; a tuple among them: one of those
    required: tuple = ()
    # it times runners at fixed shapes: what the chooser and the projection read
    systems: bool = False
    # it measures what a model answers, which random weights cannot show
    trained_only: bool = False
    # an untimed experiment's units run in this order (executor.Processes keeps a key's units on one worker)
    order: Callable | None = None
    # (Point) -> GiB a worker holds for the point beside its model's weights (accuracy: the prefill store its protocol
    # fills): how many workers share the machine's memory (executor.worker_gib)
    held_gib: Callable | None = None
    short: str | None = None  # how a sentence names it; else its name in words
    # what each workload value means, for the profile guide, where the guide's table of shared keys has no line for it
    meanings: dict[str, str] = field(default_factory=dict)
    # its chapter's opening: (rows[, gate]) -> its lead sentences (its chapter module's `lead`: kvlib.report.ttft,
    # ...; a chapter that reads the validity gate takes it second: a task counts only where the full cache passes it);
    # and the page's error rate said under it
    lead: Callable | None = None
    error_rate: str = ""
    findings: tuple[int, ...] = ()  # the paper's findings its rows test (the findings page links them to its chapter)
    # its rows of the methods page's table of sizes: (profile's name, its spec of the experiment) -> table rows
    sizes: Callable[[str, dict], list[str]] | None = None

    def answer(self, rows: pd.DataFrame, gate: float | None = None, **reads) -> str:
        """Its chapter's opening sentences, as Markdown (kvlib.report.opening); `gate`: the profile's validity gate,
        for a chapter whose lead reads one (else its lead's default, kvlib.report.gate.GATE); `reads`: what else its
        lead reads (accuracy's: `sizes`, the rows its size section reads)."""
        lead = self.lead(rows, **reads) if gate is None else self.lead(rows, gate, **reads)
        return opening(lead, rows, self.error_rate)

    @property
    def label(self) -> str:
        return self.short or self.name.replace("_", " ")


REGISTRY: dict[str, Experiment] = {}


def register(experiment: Experiment) -> Experiment:
    if experiment.name in REGISTRY:
        raise ValueError(f"two experiments are named {experiment.name!r}")
    REGISTRY[experiment.name] = experiment
    return experiment


def experiment(name: str) -> Experiment:
    if name not in REGISTRY:
        raise UserError(f"unknown experiment {name!r}; experiments: {list(REGISTRY)}")
    return REGISTRY[name]


def names(**where) -> tuple[str, ...]:
    """The experiments' names in the book's order, those whose declaration has every given value (systems=True, ...)."""
    return tuple(n for n, e in REGISTRY.items() if all(getattr(e, k) == v for k, v in where.items()))


def finding_chapters() -> dict[int, tuple[str, str]]:
    """Each of the paper's findings -> the chapter whose rows test it (its file stem and title), as declared."""
    return {n: (e.name, e.title) for e in REGISTRY.values() for n in e.findings}


def check_weights(name: str, weights: str) -> None:
    """Random weights run only the experiments that time runners: what a model answers means nothing untrained."""
    if weights == "random" and experiment(name).trained_only:
        raise UserError(f"experiment {name!r} measures what the model answers, which random weights cannot show "
                        f"({CAVEAT}: {', '.join(names(trained_only=False))}); run it with trained weights")
