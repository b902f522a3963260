"""PyramidKV (Cai et al., 2024) over SnapKV's scores: the shallow layers keeping more than the deep ones (linear in
depth, the last layer about 1/`pyramid_beta` of the mean), SnapKV's votes choosing within each layer.

The scorer is SnapKV's (kvlib.policies.snapkv) with PyramidKV's own settings, the split the scored-eviction mechanism's
`pyramid` allocation (kvlib.policies.allocation) by PyramidKV's schedule. Read: Zefan-Cai/KVCache-Factory
`pyramidkv/pyramidkv_utils.py` (PyramidKVCluster.update_kv: max_capacity_prompt less the window is the mean budget
B of the older tokens; a prompt under max_capacity_prompt kept whole, one under 2 x B kept uniform, else min = B //
beta, max = 2 x B - min, capped at the older tokens, layer l keeping max - l x ((max - min) // (L - 1)); beta 20) and
`run_longbench.py` (its runs: window 8, kernel 7, maxpool). `schedule="kvlib"` is kvlib's older schedule (the line
fixed up to exactly SnapKV's total, no uniform regime).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlib.errors import UserError
from kvlib.policies.allocation import SCHEDULES, pyramid_counts
from kvlib.policies.fidelity import Fidelity, Rule, Source
from kvlib.policies.registry import register
from kvlib.policies.snapkv import SnapKVPolicy


@register
@dataclass
class PyramidKVPolicy(SnapKVPolicy):
    name = "pyramidkv"
    adopts_prefill = True  # SnapKV's prefill; the allocation acts when the prompt is compacted, after it
    keeps = "a recent window and the entries the window's votes favour; more in shallow layers than in deep ones"

    allocation: str = "pyramid"
    window: int = 8
    kernel_size: int = 7
    pooling: str = "maxpool"
    schedule: str = "pyramidkv"  # pyramid's layer counts (kvlib.policies.allocation): "pyramidkv" or "kvlib"

    fidelity = Fidelity(Source("Zefan-Cai/KVCache-Factory", "c97f9d706d63d1b56e980f8b81b2a924c21162b3",
                               "pyramidkv/pyramidkv_utils.py, run_longbench.py"), rules=(
        Rule("budget", "max_capacity_prompt a head on average, the window in it",
             kvlib="budget x prompt, the window in it",
             differs="a share of each prompt, kvlib's one budget rule (budget_tokens: absolute)"),
        Rule("observation window", 8, setting="window"),
        Rule("pooling kernel", 7, setting="kernel_size"),
        Rule("pooling", "maxpool", setting="pooling"),
        Rule("under GQA", "per query head (K/V repeated)", kvlib="per KV head: group mean, then pooled",
             differs="one copy per KV head (the official opt-in kv_head layout)"),
        Rule("prompt under the budget", "kept whole", kvlib="kept whole"),
        Rule("last layer (beta)", 20, setting="pyramid_beta"),
        Rule("layer counts", "pyramidkv", setting="schedule"),
        Rule("layer lengths", "each layer its own", kvlib="every layer padded to the widest in the row's blocks "
             "(booked, and compared, as kv)", differs="one block table a row: the padding is memory the official cache does not hold"),
    ), note="pyramidkv: under 2 x B uniform, else max - l x step, capped at the older tokens, the step rounded down; "
            "kvlib: the line fixed up to exactly L x B (kvlib's older schedule).")

    def __post_init__(self):
        super().__post_init__()
        if self.schedule not in SCHEDULES:
            raise UserError(f"schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")

    def heavy_counts(self, scores, heavy):
        if self.allocation == "pyramid":  # the window kept beside (limits: the whole window wherever heavy > 0)
            layers, heads, n = scores.shape
            return pyramid_counts(layers, heads, heavy, n, self.pyramid_beta, self.window, self.schedule)
        return super().heavy_counts(scores, heavy)
