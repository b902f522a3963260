"""Wall-time accounting shared by the engine and the policies: one rule for every policy.

A section's seconds are exclusive: time spent in a section nested inside it (a policy's `fetch` inside the engine's
decode `pass`) is counted in the nested one only, so the sections of a run add up to the time they cover and a wall
split is a plain sum (kvlib.engine.run_result.wall_split). Sections are keyed `<phase>.<name>`, the phase (`setup`,
`prefill`, `decode`) set by the engine.

On CUDA, a section records events on the current stream and never synchronizes the host: the engine synchronizes
once per step (`Timers.now`), whatever the policy, and the events are read then. Timing a section therefore costs every
policy the same, however many sections it has.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch


class Timers:
    """The engine's timer sections (above)."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.phase = "setup"
        self.seconds: dict[str, float] = defaultdict(float)
        self._open: list[int] = []  # indices into _records of the sections entered and not yet left
        self._records: list[list] = []  # [key, start mark, end mark, parent index] awaiting settle()

    def reset(self) -> None:
        self.seconds.clear()
        self._open.clear()
        self._records.clear()
        self.phase = "setup"

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @contextmanager
    def section(self, name: str):
        record = [f"{self.phase}.{name}", self._mark(), None, self._open[-1] if self._open else None]
        self._records.append(record)
        self._open.append(len(self._records) - 1)
        try:
            yield
        finally:
            record[2] = self._mark()
            self._open.pop()
            if not self._open and not self.cuda:
                self.settle()

    def settle(self) -> None:
        """Turn the closed sections' marks into exclusive seconds (on CUDA: after the host has synchronized)."""
        if self._open:
            return
        for key, start, end, parent in self._records:
            elapsed = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            self.seconds[key] += elapsed
            if parent is not None:
                self.seconds[self._records[parent][0]] -= elapsed
        self._records.clear()

    def now(self) -> float:
        """The engine's clock: on CUDA, the one host synchronization of a step (and the pending events are read)."""
        if self.cuda:
            torch.cuda.synchronize()
            self.settle()
        return time.perf_counter()


class NoTimers(Timers):
    """Sections that time nothing: a timed run's, whose time is taken by its caller alone (kvlib.study.experiments.
    common.run_timed); the sections of the same work come from the untimed run before it."""

    def section(self, name: str):
        return nullcontext()
