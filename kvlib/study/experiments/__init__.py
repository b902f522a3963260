"""The study's experiments, one module each: its `run_point(point, kept) -> list[dict]` and its declaration
(kvlib.study.experiment), which importing this package registers, in the book's order."""

from kvlib.study.experiment import REGISTRY, Experiment, check_weights, experiment, finding_chapters, names

# the registry's order is the book's: each module registers itself as it is imported
# isort: off
from kvlib.study.experiments import (  # noqa: F401
    ttft,
    batch_scaling,
    decode_length,
    offload,
    serving,
    accuracy,
    retention,
)
# isort: on

__all__ = ["REGISTRY", "Experiment", "check_weights", "experiment", "finding_chapters", "names"]
