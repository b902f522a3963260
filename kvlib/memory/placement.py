"""Where FlexGen puts things: its `--percent W_DEV W_HOST KV_DEV KV_HOST ACT_DEV ACT_HOST` (the disk takes the rest of
each pair), read and checked once, and FlexGen's two rules that turn percentages into a placement
(FMInference/FlexLLMGen@004ffef):

- weights (`flex_opt.py` init_weight_list): within each of FlexGen's layers (a decoder layer's attention, its MLP), the
  tensors are laid end to end in their order by size, the tiers end to end disk, host, device by their percents, and
  each tensor goes whole to the tier in whose share its midpoint falls; so every layer is split the same way;
- KV (`pytorch_backend.py` TorchMixedDevice.init_cache_one_gpu_batch): each GPU batch's cache is cut along batch x
  heads (never along tokens) into a device, a host and a disk segment, the device's and (where the disk has a share)
  the host's rounded down to whole rows, the last tier with a share taking the rest.

Activations are computed on the device: ACT_DEV must be 100 here (FlexGen too keeps the activations of the layer it
computes on the compute device; its CPU/disk activation shares only park hidden states between layers of a large
batch, which kvlib's one forward pass per step never holds).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlib.errors import UserError

TIERS = ("device", "host", "disk")
KV_CODECS = ("none", "int4")


@dataclass(frozen=True)
class Placement:
    weights: tuple[float, float, float]  # shares (device, host, disk), summing to 1
    kv: tuple[float, float, float]
    percents: tuple[float, ...] = (100, 0, 100, 0, 100, 0)  # the six numbers as given (FlexGen rounds from these)

    @classmethod
    def parse(cls, percent) -> Placement:
        """From six percentages (a list, or a string of six numbers separated by spaces or commas)."""
        values = percent
        if isinstance(percent, str):
            values = percent.replace(",", " ").split()
        try:
            values = [float(v) for v in values]
        except (TypeError, ValueError):
            raise UserError(f"percent needs six numbers (W_DEV W_HOST KV_DEV KV_HOST ACT_DEV ACT_HOST), "
                            f"got {percent!r}") from None
        if len(values) != 6:
            raise UserError(f"percent needs six numbers (W_DEV W_HOST KV_DEV KV_HOST ACT_DEV ACT_HOST), "
                            f"got {len(values)}: {percent!r}")
        if any(not 0 <= v <= 100 for v in values):
            raise UserError(f"every percent must be in [0, 100], got {values}")
        for what, (a, b) in (("weights", values[0:2]), ("kv", values[2:4]), ("activations", values[4:6])):
            if a + b > 100:
                raise UserError(f"percent: the {what} shares on device and host add up to {a + b} > 100")
        if values[4] != 100:
            raise UserError(f"percent: activations are computed on the device here (ACT_DEV must be 100, got "
                            f"{values[4]:g})")

        def shares(a, b):
            return a / 100, b / 100, max(0.0, 1 - (a + b) / 100)

        return cls(shares(*values[0:2]), shares(*values[2:4]), tuple(values))

    @property
    def all_on_device(self) -> bool:
        return self.weights[0] == 1 and self.kv[0] == 1


def kv_split(rows: int, heads: int, dev_percent: float, host_percent: float) -> tuple[int, int, int]:
    """A GPU batch's rows x heads cut into device, host and disk segments (counts of (row, head)s, row-major), as
    TorchMixedDevice.init_cache_one_gpu_batch cuts them: the device's int(n x percent / 100) rounded down to whole
    rows; with no disk share the host takes the rest, else the host's rounded down the same way and the disk the
    rest (so at 1 row, `KV_DEV 0 KV_HOST 50` puts the whole row on disk)."""
    n = rows * heads
    dev = int(n * dev_percent / 100) // heads * heads
    if 100 - dev_percent - host_percent == 0:
        return dev, n - dev, 0
    host = int(n * host_percent / 100) // heads * heads
    return dev, host, n - dev - host


def tensor_tiers(sizes: list[int], dev_percent: float, host_percent: float) -> list[str]:
    """The tier of each tensor of one layer, as init_weight_list places them: the tensor's midpoint within the
    layer's elements, as a percent, against the cumulative percents of disk, host and device (in that order; a
    midpoint below a bound goes to that tier)."""
    bounds = np.cumsum([100 - dev_percent - host_percent, host_percent, dev_percent])
    total, before, tiers = sum(sizes), 0, []
    for size in sizes:
        mid = (before + size / 2) / total * 100
        before += size
        tiers.append(next((t for t, b in zip(("disk", "host", "device"), bounds) if mid < b), "device"))
    return tiers
