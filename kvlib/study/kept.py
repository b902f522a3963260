"""What a process computing points keeps from one point to the next. The executor holds one for its process (each
worker process its own: kvlib.study.executor) and hands it to every point's `run_point(point, kept)`, so that no
experiment keeps state of its own between points, and a test hands a point a fresh one.

It keeps the models loaded (the last two; one beside a store, as kvlib.study.executor.worker_gib counts a worker),
each point's untimed run (the timing protocol's warm-up, kvlib.study.experiments.common.warm_then_timed) and what an
experiment builds or measures once for many points (the accuracy experiment's prefill store, the offload
experiment's disk read rate)."""

from __future__ import annotations

import gc
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

from kvlib.models import LoadedModel, load_model

T = TypeVar("T")


class Kept:
    def __init__(self, max_models: int = 2):
        self.max_models = max_models
        self.models: OrderedDict[tuple, LoadedModel] = OrderedDict()  # (name, device, weights) -> the model
        self.untimed: dict[str, dict] = {}  # a point's key -> its untimed run's row
        self.once: dict[object, object] = {}  # an experiment's key -> what it built or measured

    def model(self, name: str, device: str | None = None, weights: str = "pretrained") -> LoadedModel:
        """The model, loaded at its first use; the least recently used one dropped past max_models."""
        key = (name, device, weights)
        if key not in self.models:
            self.models[key] = load_model(name, device=device, weights=weights)
            while len(self.models) > self.max_models:
                self.models.popitem(last=False)
        self.models.move_to_end(key)
        return self.models[key]

    def only(self, loaded: LoadedModel) -> None:
        """Drop every model but `loaded`: a worker's memory holds one model beside what an experiment stores for it
        (a 1.5B model kept beside a 16 GB prefill store for a small one filled a 24 GB machine)."""
        for key in [key for key, model in self.models.items() if model is not loaded]:
            del self.models[key]
        gc.collect()

    def release(self) -> None:
        """Drop every model and everything built once (an accuracy prefill store): worker processes are about to
        compute, and each was counted the machine's whole memory (kvlib.study.executor.untimed_workers), none of it
        for this process."""
        self.models.clear()
        self.once.clear()
        gc.collect()

    def get(self, key: object, make: Callable[[], T]) -> T:
        """What `make()` returned the first time this key was asked for."""
        if key not in self.once:
            self.once[key] = make()
        return self.once[key]
