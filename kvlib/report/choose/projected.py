"""The chooser's answer on hardware the book did not measure (`kvlib choose --hardware NAME --model NAME`): the
workload projected onto it (kvlib.projection.paper_scale.for_workload), every figure labelled projected."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ProjectedChoice:
    rows: list[dict]  # one per runner: kvlib.projection.paper_scale.projection's columns

    def text(self) -> str:
        import pandas as pd

        from kvlib.projection.paper_scale import workload_text

        return workload_text(pd.DataFrame(self.rows))


def choose_projected(model: str, hardware: str, prompt: int, batch: int, output: int,
                     profile: str = "embedded") -> ProjectedChoice:
    from kvlib.projection.paper_scale import for_workload

    return ProjectedChoice(for_workload(model, hardware, prompt, batch, output, profile).to_dict("records"))
