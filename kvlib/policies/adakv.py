"""Ada-KV (Feng et al., 2024) over SnapKV's scores: the same budget as SnapKV, split across each layer's KV heads by
where the observation window's votes fall, every head keeping at least `floor_alpha` of the uniform count.

The scorer is SnapKV's (kvlib.policies.snapkv) with Ada-KV's own settings, the split the scored-eviction mechanism's
`adaptive` allocation (kvlib.policies.allocation) by Ada-KV's formula. Read: FFY0/AdaKV
`adaptive_snapkv/monkeypatch/snapkv_utils.py` (AdaptiveSnapKVCluster: window_size 32, kernel_size 7, maxpool;
base_capacity less the window is a head's mean budget B of the older tokens; head h keeps round(c_h x (1 - alpha) +
int(alpha x B)), c_h its count among the layer's top H x B scores; gqa_support: the group's mean, then pooled) and
`experiments/LongBench/GQA_eval_longbench.sh` (the runs: c*_w32_k7_maxpool, floor_alpha 0.2). `formula="kvpress"` is
kvlib's older rule (the floor first, then the flattened top-k of the rest, as NVIDIA/kvpress's AdaKVPress shapes it).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlib.errors import UserError
from kvlib.policies.allocation import FORMULAS, adaptive_counts
from kvlib.policies.fidelity import Fidelity, Rule, Source
from kvlib.policies.registry import register
from kvlib.policies.snapkv import SnapKVPolicy


@register
@dataclass
class AdaKVPolicy(SnapKVPolicy):
    name = "adakv"
    adopts_prefill = True  # SnapKV's prefill; the allocation acts when the prompt is compacted, after it
    keeps = "a recent window and, per head, the entries its window's votes favour; head budgets follow the votes"

    allocation: str = "adaptive"
    window: int = 32
    kernel_size: int = 7
    pooling: str = "maxpool"
    formula: str = "adakv"  # adaptive's rule (kvlib.policies.allocation): "adakv" (FFY0's) or "kvpress"

    fidelity = Fidelity(Source("FFY0/AdaKV", "efe4e2eea0099bf497f0c175ac5440a915d89f83",
                               "adaptive_snapkv/monkeypatch/snapkv_utils.py, "
                               "experiments/LongBench/GQA_eval_longbench.sh"), rules=(
        Rule("budget", "base_capacity a head on average, the window in it", kvlib="budget x prompt, the window in it",
             differs="a share of each prompt, kvlib's one budget rule (budget_tokens: absolute)"),
        Rule("observation window", 32, setting="window"),
        Rule("pooling kernel", 7, setting="kernel_size"),
        Rule("pooling", "maxpool", setting="pooling"),
        Rule("under GQA (gqa_support)", "per KV head: group mean, then pooled",
             kvlib="per KV head: group mean, then pooled"),
        Rule("floor (floor_alpha)", 0.2, setting="floor_alpha"),
        Rule("allocation", "adakv", setting="formula"),
        Rule("layers left uniform (skip)", 0, kvlib=0),
        Rule("budget = the prompt's older part", "compressed: rounding may drop an entry", kvlib="kept whole",
             differs="budget 1.0 is the full cache"),
        Rule("head lengths", "each head its own (flattened cache)",
             kvlib="heads padded to the widest in the row's blocks (booked, and compared, as kv)",
             differs="one block table a row: the padding is memory the official cache does not hold"),
    ), note="adakv: round(c_h x (1 - alpha) + int(alpha x B)), c_h the head's count among the layer's top H x B; "
            "kvpress: the floor first, then the layer's top of the rest (kvlib's older rule).")

    def __post_init__(self):
        super().__post_init__()
        if self.formula not in FORMULAS:
            raise UserError(f"formula must be one of {list(FORMULAS)}, got {self.formula!r}")

    def heavy_counts(self, scores, heavy):
        if self.allocation == "adaptive":
            return adaptive_counts(scores, heavy, self.floor_alpha, self.formula).cpu()
        return super().heavy_counts(scores, heavy)
