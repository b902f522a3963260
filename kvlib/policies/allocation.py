"""How the scored-eviction policies split one budget across layers and KV heads when a prompt is compacted.

A row keeps, per (layer, KV head), its `recent` newest tokens and some best-scored older ("heavy") ones. `uniform`
gives every head the same heavy count; the others move heavy tokens between heads and keep the total, so a policy
holds as many entries as at `uniform`, placed where attention is:
- `adaptive` (Ada-KV, Feng et al. 2024): within each layer, every head first gets a floor, `alpha` of the uniform
  count; the rest of the layer's H x heavy goes to the layer's best-scored (head, token) pairs not yet taken, so a head
  gets as many as it has among the layer's top scores.
- `pyramid` (PyramidKV, Cai et al. 2024): the same count for the heads of a layer, decreasing linearly with depth from
  the first layer to the last, the last getting 1/beta of the mean, the mean that of `uniform`.

Read: FFY0/AdaKV (its flattened top-k over a layer's head-wise scores, and the floor_alpha guarantee), NVIDIA/kvpress's
AdaKVPress (the same on any scorer's scores), Zefan-Cai/KVCache-Factory's PyramidKV (min = budget / beta, max = 2 x
budget - min, linear steps over the layers; the observation window kept beside it). Deviations: only the older part is
allocated (the recent window every head keeps, as both keep their observation window); integer counts are fixed up so
that the total is exactly uniform's, and a layer's count never exceeds the tokens it has (what a capped layer cannot
hold goes to the shallowest layers with room), so at budget 1.0 every entry is kept.
"""

from __future__ import annotations

import torch

ALLOCATIONS = ("uniform", "adaptive", "pyramid")


def adaptive_counts(scores: torch.Tensor, heavy: int, alpha: float) -> torch.Tensor:
    """scores [L, H, n] of the older tokens; returns [L, H] heavy counts, each >= floor(alpha x heavy), each layer's
    summing to H x heavy."""
    layers, heads, n = scores.shape
    if not 0 <= heavy <= n:
        raise ValueError(f"heavy must be in [0, {n}], got {heavy}")
    floor = int(alpha * heavy)
    counts = torch.full((layers, heads), floor, dtype=torch.long)
    rest = heads * (heavy - floor)
    if rest == 0:
        return counts
    free = scores.float().clone()
    if floor:  # each head's own best `floor` tokens are taken
        free.scatter_(-1, free.topk(floor, dim=-1).indices, float("-inf"))
    best = free.flatten(1).topk(rest, dim=-1).indices // n  # [L, rest]: the head of each of the layer's best pairs
    return counts + torch.nn.functional.one_hot(best, heads).sum(dim=1)


def pyramid_counts(layers: int, heads: int, heavy: int, n: int, beta: float) -> torch.Tensor:
    """[L, H] heavy counts: one per layer, linear in depth from 2 x heavy - heavy / beta down to heavy / beta, summing
    to L x heavy, at most n (the older tokens a head has)."""
    if not 0 <= heavy <= n:
        raise ValueError(f"heavy must be in [0, {n}], got {heavy}")
    low = heavy / beta
    high = 2 * heavy - low
    depth = torch.arange(layers, dtype=torch.float64)
    counts = (high - (high - low) * depth / max(layers - 1, 1)).floor().long() if layers > 1 else \
        torch.tensor([heavy])
    counts = counts.clamp(0, n)
    short = layers * heavy - int(counts.sum())  # rounding and capping: given to the shallowest layers with room
    for layer in range(layers):
        if short <= 0:
            break
        add = min(short, n - int(counts[layer]))
        counts[layer] += add
        short -= add
    return counts[:, None].expand(layers, heads).clone()


def select_per_head(scores: torch.Tensor, heavy: torch.Tensor, recent: int) -> torch.Tensor:
    """scores [L, H, n]; heavy [L, H]. Per head, its `heavy` best-scored older tokens then its `recent` newest, in
    position order, then padding (index 0) up to the widest head: [L, H, max(heavy) + recent]."""
    n = scores.shape[-1]
    older = n - recent
    widest = int(heavy.max())
    top = scores[..., :older].topk(widest, dim=-1).indices  # best first
    taken = torch.arange(widest, device=scores.device) < heavy.to(scores.device)[..., None]
    top = top.masked_fill(~taken, n)  # beyond a head's count: sorts last
    tail = torch.arange(older, n, device=scores.device).expand(*scores.shape[:-1], -1)
    chosen = torch.cat([top, tail], dim=-1).sort(dim=-1).values
    return chosen.masked_fill(chosen == n, 0)


def widest_count(allocation: str, heavy: int, older: int, heads: int, layers: int, alpha: float) -> int:
    """The most older tokens one head can keep under an allocation when a uniform head keeps `heavy` of `older`: what
    a row's slots must hold, its heads sharing them (adaptive: a head's floor and every other head's share of the
    layer; pyramid: the first layer's count, with what rounding leaves, at most one token a layer)."""
    if allocation == "adaptive":
        floor = int(alpha * heavy)
        return min(older, floor + heads * (heavy - floor))
    if allocation == "pyramid":
        return min(older, 2 * heavy + layers)
    return heavy
