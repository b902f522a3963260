"""PyramidKV (Cai et al., 2024) over SnapKV's scores: the same total budget as SnapKV, the shallow layers keeping more
than the deep ones (linear in depth, the last layer 1/`pyramid_beta` of the mean), SnapKV's votes choosing within
each layer.

The scorer is SnapKV's (kvlib.policies.snapkv), the split the scored-eviction mechanism's `pyramid` allocation
(kvlib.policies.allocation): this class only names the combination (`--policy pyramidkv`, or `--policy snapkv --set
allocation=pyramid`: the same run). Read: Zefan-Cai/KVCache-Factory's PyramidKV (beta 20, the observation window kept
beside each layer's budget).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlib.policies.registry import register
from kvlib.policies.snapkv import SnapKVPolicy


@register
@dataclass
class PyramidKVPolicy(SnapKVPolicy):
    name = "pyramidkv"
    adopts_prefill = True  # SnapKV's prefill; the allocation acts when the prompt is compacted, after it
    keeps = "a recent window and the entries the window's votes favour; more in shallow layers than in deep ones"

    allocation: str = "pyramid"
