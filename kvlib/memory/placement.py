"""Where FlexGen puts things: its `--percent W_DEV W_HOST KV_DEV KV_HOST ACT_DEV ACT_HOST` (the disk takes the rest of
each pair), read and checked once, and the two rules that turn percentages into a placement:

- weights: a layer's weights go whole to one tier, the tier in whose share the midpoint of the layer's bytes falls
  (layers laid end to end by size, the shares laid end to end device, host, disk);
- KV: each layer's cache is cut along batch x heads (never along tokens) into a device, a host and a disk segment of
  the given shares, rounded so that the segments cover every (row, head) exactly once.

Activations are computed on the device: ACT_DEV must be 100 here (FlexGen too keeps the activations of the layer it
computes on the compute device; its CPU/disk activation shares only park hidden states between layers of a large
batch, which kvlib's one forward pass per step never holds).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlib.errors import UserError

TIERS = ("device", "host", "disk")
KV_CODECS = ("none", "int4")


@dataclass(frozen=True)
class Placement:
    weights: tuple[float, float, float]  # shares (device, host, disk), summing to 1
    kv: tuple[float, float, float]

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

        return cls(shares(*values[0:2]), shares(*values[2:4]))

    @property
    def all_on_device(self) -> bool:
        return self.weights[0] == 1 and self.kv[0] == 1


def split_counts(n: int, shares: tuple[float, float, float]) -> tuple[int, int, int]:
    """n items (rows x heads) cut into device, host and disk segments of these shares; the cut points are rounded
    to the nearest item, so the segments sum to n."""
    first = round(n * shares[0])
    second = round(n * (shares[0] + shares[1]))
    first, second = min(first, n), min(max(second, first), n)
    return first, second - first, n - second


def weight_tiers(layer_bytes: list[int], shares: tuple[float, float, float]) -> list[str]:
    """The tier of each layer: the one in whose share the midpoint of the layer's bytes falls."""
    total = sum(layer_bytes)
    bounds = (shares[0] * total, (shares[0] + shares[1]) * total)
    tiers, before = [], 0
    for size in layer_bytes:
        mid = before + size / 2
        tiers.append("device" if mid < bounds[0] else "host" if mid < bounds[1] else "disk")
        before += size
    return tiers
