"""Wall-time accounting shared by the engine and the policies."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class Timers:
    """Accumulates seconds per named section; synchronizes CUDA so GPU work lands in the section that issued it."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextmanager
    def section(self, name: str):
        start = self.now()
        try:
            yield
        finally:
            self.seconds[name] += self.now() - start
