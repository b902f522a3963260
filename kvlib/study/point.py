"""A grid point of a profile's experiment (kvlib.study.profile expands a profile into them): what an experiment's
`run_point` receives, and whose key names its results files."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from functools import cached_property

from kvlib.settings import capacity_bytes
from kvlib.study.runners import runner_class


@dataclass(frozen=True)
class Point:
    """One grid point: which runner with which settings, on which workload. Its key names its results files."""

    experiment: str
    runner: str
    settings: dict  # the runner's complete settings
    values: dict  # the workload: grid and fixed values that are no runner setting
    model: str
    weights: str = "pretrained"
    device: str | None = None
    device_capacity_gb: float | None = None

    @cached_property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True, default=str).encode()).hexdigest()[:16]

    @property
    def capacity_bytes(self) -> int | None:
        return capacity_bytes(self.device_capacity_gb)

    def columns(self) -> dict:
        """The point as flat result columns: the runner (its label as `policy`), each setting and workload value in a
        column of its own (nested values as JSON), and the key."""
        cls = runner_class(self.runner)
        flat = {k: json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v
                for k, v in {**self.settings, **self.values}.items()}
        return {"experiment": self.experiment, "runner": self.runner, "policy": cls.label, "outside": cls.outside,
                "lossless": cls.lossless and not self.settings.get("compress_cache"),  # (flexgen's 4-bit cache)
                "model": self.model, "weights": self.weights, "device": self.device,
                "device_capacity_gb": self.device_capacity_gb, **flat, "point_hash": self.key}
