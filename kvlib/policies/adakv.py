"""Ada-KV (Feng et al., 2024) over SnapKV's scores: the same budget as SnapKV, split across each layer's KV heads by
where the observation window's votes fall, every head keeping at least `floor_alpha` of the uniform count.

The scorer is SnapKV's (kvlib.policies.snapkv), the split the scored-eviction mechanism's `adaptive` allocation
(kvlib.policies.allocation): this class only names the combination, so that a profile or the command line can run it
beside SnapKV (`--policy adakv`, or `--policy snapkv --set allocation=adaptive`: the same run). Read: FFY0/AdaKV (its
SnapKV integration, floor_alpha 0.2) and NVIDIA/kvpress's AdaKVPress wrapping SnapKVPress.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlib.policies.registry import register
from kvlib.policies.snapkv import SnapKVPolicy


@register
@dataclass
class AdaKVPolicy(SnapKVPolicy):
    name = "adakv"
    adopts_prefill = True  # SnapKV's prefill; the allocation acts when the prompt is compacted, after it
    keeps = "a recent window and, per head, the entries its window's votes favour; head budgets follow the votes"

    allocation: str = "adaptive"
