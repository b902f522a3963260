"""Every byte a policy or the engine holds, booked by tier and component, with peaks and a device capacity.

On a CPU there is no separate device memory, so the ledger *is* the device-memory measurement: weights and KV are
booked from the tensors actually allocated, activations from the working set of each forward pass. A configurable
capacity turns "does not fit" into a recorded OOM point. On CUDA, torch.cuda's own statistics are reported beside it.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch

from kvlib.errors import DeviceOOM

# disk: files of an offload folder (kvlib.memory.disk), for the policies that place KV there (flexgen)
TIERS = ("device", "host", "disk")
# weights_packed: copies of weights kept beside them in a faster layout (a tied LM head packed for oneDNN): what the
# speed costs in memory, shown apart
COMPONENTS = ("weights", "weights_packed", "activations", "kv", "kv_reserved", "overhead")


class MemoryLedger:
    def __init__(self, device_capacity: int | None = None, unmeasured: tuple[str, ...] = ()):
        self.capacity = device_capacity
        self.unmeasured = unmeasured  # components a backend cannot see: reported as None, never 0
        self.clear()

    def clear(self) -> None:
        self.current: dict[tuple[str, str], int] = defaultdict(int)
        self.peak: dict[tuple[str, str], int] = defaultdict(int)
        self.peak_total: dict[str, int] = defaultdict(int)

    def total(self, tier: str) -> int:
        return sum(v for (t, _), v in self.current.items() if t == tier)

    def add(self, tier: str, component: str, nbytes: int, where: str = "") -> None:
        assert tier in TIERS and component in COMPONENTS, (tier, component)
        if nbytes > 0 and tier == "device" and self.capacity is not None:
            in_use = self.total("device")
            if in_use + nbytes > self.capacity:
                raise DeviceOOM(where or component, nbytes, in_use, self.capacity)
        key = (tier, component)
        self.current[key] += nbytes
        self.peak[key] = max(self.peak[key], self.current[key])
        self.peak_total[tier] = max(self.peak_total[tier], self.total(tier))

    def set(self, tier: str, where: str = "", **components: int) -> None:
        """Set several components of a tier at once; capacity is checked on the net change, so moving bytes from
        `kv_reserved` to `kv` never counts them twice."""
        delta = sum(n - self.current[(tier, c)] for c, n in components.items())
        if delta > 0 and tier == "device" and self.capacity is not None:
            in_use = self.total(tier)
            if in_use + delta > self.capacity:
                raise DeviceOOM(where or "/".join(components), delta, in_use, self.capacity)
        for component, nbytes in components.items():
            assert component in COMPONENTS, component
            self.current[(tier, component)] = nbytes
            self.peak[(tier, component)] = max(self.peak[(tier, component)], nbytes)
        self.peak_total[tier] = max(self.peak_total[tier], self.total(tier))

    @contextmanager
    def transient(self, tier: str, component: str, nbytes: int, where: str):
        """Book a working buffer for the duration of a block (and fail before allocating it if it does not fit)."""
        self.add(tier, component, nbytes, where)
        try:
            yield
        finally:
            self.add(tier, component, -nbytes)

    def held(self, tier: str, component: str = "kv") -> int | None:
        """What a component of a tier holds now; None where this ledger cannot see it."""
        return None if component in self.unmeasured else self.current[(tier, component)]

    def snapshot(self) -> dict:
        out = {}
        for tier in TIERS:
            comps = {c: self.current[(tier, c)] for c in COMPONENTS}
            out[tier] = {
                "kv_bytes": None if "kv" in self.unmeasured else comps["kv"],
                "total_bytes": sum(comps.values()),
                "peak_bytes": self.peak_total[tier],
                "components": comps,
                "peak_components": {c: self.peak[(tier, c)] for c in COMPONENTS},
            }
            for c in self.unmeasured:
                out[tier]["components"][c] = out[tier]["peak_components"][c] = None
        out["device"]["capacity_bytes"] = self.capacity
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = {
                "allocated_bytes": torch.cuda.memory_allocated(),
                "max_allocated_bytes": torch.cuda.max_memory_allocated(),
                "reserved_bytes": torch.cuda.memory_reserved(),
            }
        return out


class NoLedger(MemoryLedger):
    """A ledger that books nothing and checks no capacity: a timed run's, whose memory is read in the untimed run before
    it on the same prompts (which would have run out first; kvlib.study.experiments.common.run_timed). Its snapshot
    reports every component as not measured."""

    def __init__(self):
        super().__init__(unmeasured=COMPONENTS)

    def add(self, tier: str, component: str, nbytes: int, where: str = "") -> None:
        pass

    def set(self, tier: str, where: str = "", **components: int) -> None:
        pass

    def transient(self, tier: str, component: str, nbytes: int, where: str):
        return nullcontext()

    def snapshot(self) -> dict:
        out = super().snapshot()
        for tier in TIERS:
            out[tier].update(total_bytes=None, peak_bytes=None)
        return out
