"""The chooser's answer on hardware the book did not measure (`kvlib choose --hardware NAME --model NAME`): the
workload projected onto it (kvlib.projection.your_workload.for_workload), every figure labelled projected."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class ProjectedChoice:
    rows: list[dict]  # one per runner: kvlib.projection.paper_scale.projection's columns
    device_limit_gb: float | None = None  # the device memory the user allows (--device-memory-gb)
    rulings: dict[str, str] = field(default_factory=dict)  # runner -> the measured answer's accuracy ruling

    def text(self) -> str:
        import pandas as pd

        from kvlib.projection.your_workload import workload_text

        return workload_text(pd.DataFrame(self.rows), self.device_limit_gb, self.rulings)


def choose_projected(model: str, hardware: str, prompt: int, batch: int, output: int, profile: str = "embedded",
                     device_limit_gb: float | None = None, measured=None,
                     systems: list[tuple[str, str, dict]] = ()) -> ProjectedChoice:
    """measured: the answer on the measured rows (a Choice), whose accuracy rulings stand beside each projection:
    a bound on speed says nothing of what a policy loses. systems: the profile's systems runners beside the paper's
    (kvlib.study.profile.Profile.systems_runners)."""
    from kvlib.projection.your_workload import for_workload

    rulings = {}
    if measured is not None:
        rulings = {**{p: "not asked" for p in measured.not_asked}, **{p: "not measured" for p in measured.unmeasured},
                   **{p: "cannot tell (see below)" for p in measured.undecided},
                   **{p: "ruled out (see below)" for p in measured.excluded}}
    table = for_workload(model, hardware, prompt, batch, output, profile, systems)
    # a figure a row has not (a runner not projected, an estimate without kernel tables) is None, valid in --json
    rows = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
            for row in table.to_dict("records")]
    return ProjectedChoice(rows, device_limit_gb, rulings)
