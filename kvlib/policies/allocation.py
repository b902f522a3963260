"""How the scored-eviction policies split one budget across layers and KV heads when a prompt is compacted.

A row keeps, per (layer, KV head), its `recent` newest tokens (the observation window) and some best-scored older
("heavy") ones; `heavy` is what a uniform head keeps of the older part (the official codes' max_capacity_prompt or
base_capacity less the window). `uniform` gives every head that count; the others move it between heads or layers:
- `adaptive` (Ada-KV, Feng et al. 2024), by `formula`:
  - `adakv` (FFY0/AdaKV `AdaptiveSnapKVCluster.update_kv`, the default): c_h = how many of the layer's top
    H x heavy (head, token) scores are head h's, and head h keeps round(c_h x (1 - alpha) + int(alpha x heavy)). The
    counts are rounded one by one, so a layer's total can differ from H x heavy by a few entries.
  - `kvpress` (kvlib's older rule, the shape of NVIDIA/kvpress's AdaKVPress): every head first keeps its own best
    int(alpha x heavy) (kvpress counts the window in that floor, kvlib does not); the rest of the layer's H x heavy
    goes to its best-scored (head, token) pairs not yet taken. A layer's total is exactly H x heavy.
  The two differ wherever a head's share of the layer's top scores is not the floor plus its best pairs beyond it
  (scores [[9, 8, 7, 1], [6, 0, 0, 0]], heavy 2, alpha 0.5: adakv [[2, 2]], kvpress [[3, 1]]).
- `pyramid` (PyramidKV, Cai et al. 2024): one count for every head of a layer, by `schedule`:
  - `pyramidkv` (Zefan-Cai/KVCache-Factory `PyramidKVCluster.update_kv`, the default): a prompt (the window included)
    shorter than 2 x heavy keeps heavy in every layer; else min = heavy // beta, max = 2 x heavy - min, capped: where
    max >= the older tokens n, max = n and min = 2 x heavy - n; layer l keeps max - l x ((max - min) // (L - 1)). The
    step is rounded down, so the deeper layers keep more than the line and the total exceeds L x heavy.
  - `kvlib` (kvlib's older rule): the same line in floats, floored, then fixed up to exactly L x heavy, a capped
    layer's excess given to the shallowest layers with room; no uniform regime.
Which entries a head keeps: `select_heavy_recent` (one count for every head) or `select_per_head` (its own count).
A prompt whose budget is all of it is kept whole under every rule: the official codes leave a prompt under the budget
alone, and kvlib a prompt at it too (FFY0 compresses at heavy = n, where its rounding can drop an entry).
"""

from __future__ import annotations

import torch

ALLOCATIONS = ("uniform", "adaptive", "pyramid")
FORMULAS = ("adakv", "kvpress")  # adaptive
SCHEDULES = ("pyramidkv", "kvlib")  # pyramid


def adaptive_counts(scores: torch.Tensor, heavy: int, alpha: float, formula: str = "adakv") -> torch.Tensor:
    """scores [L, H, n] of the older tokens; returns [L, H] heavy counts, each >= int(alpha x heavy) and <= n."""
    layers, heads, n = scores.shape
    if not 0 <= heavy <= n:
        raise ValueError(f"heavy must be in [0, {n}], got {heavy}")
    floor = int(alpha * heavy)
    if formula == "adakv":
        if heavy == n:  # the budget covers the older part: every head keeps it whole (see above)
            return torch.full((layers, heads), n, dtype=torch.long)
        share = _head_shares(scores.float(), heads * heavy)
        return torch.round(share * (1 - alpha) + floor).long()  # float32 arithmetic and half-to-even, as FFY0's
    if formula != "kvpress":
        raise ValueError(f"formula must be one of {list(FORMULAS)}, got {formula!r}")
    counts = torch.full((layers, heads), floor, dtype=torch.long)
    rest = heads * (heavy - floor)
    if rest == 0:
        return counts
    free = scores.float().clone()
    if floor:  # each head's own best `floor` tokens are taken
        free.scatter_(-1, free.topk(floor, dim=-1).indices, float("-inf"))
    return counts + _head_shares(free, rest)


def _head_shares(scores: torch.Tensor, top: int) -> torch.Tensor:
    """[L, H]: how many of each layer's `top` best (head, token) scores are each head's."""
    _, heads, n = scores.shape
    best = scores.flatten(1).topk(top, dim=-1).indices // n  # [L, top]: the head of each of the layer's best pairs
    return torch.nn.functional.one_hot(best, heads).sum(dim=1)


def pyramid_counts(layers: int, heads: int, heavy: int, n: int, beta: float, window: int = 0,
                   schedule: str = "pyramidkv") -> torch.Tensor:
    """[L, H] heavy counts, one per layer, each at most n (the older tokens a head has); window: the recent tokens
    kept beside them (PyramidKV compares the whole prompt, n + window, with 2 x heavy)."""
    if not 0 <= heavy <= n:
        raise ValueError(f"heavy must be in [0, {n}], got {heavy}")
    if schedule == "pyramidkv":
        per_layer = _pyramidkv_layers(layers, heavy, n, beta, window)
    elif schedule == "kvlib":
        per_layer = _kvlib_layers(layers, heavy, n, beta)
    else:
        raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
    return per_layer[:, None].expand(layers, heads).clone()


def _pyramidkv_layers(layers: int, heavy: int, n: int, beta: float, window: int) -> torch.Tensor:
    if layers == 1 or n + window < 2 * heavy:  # (one layer: the official code divides by zero)
        return torch.full((layers,), heavy, dtype=torch.long)
    low = int(heavy // beta)
    high = 2 * heavy - low
    if high >= n:
        high, low = n, 2 * heavy - n
    step = (high - low) // (layers - 1)
    return high - step * torch.arange(layers, dtype=torch.long)


def _kvlib_layers(layers: int, heavy: int, n: int, beta: float) -> torch.Tensor:
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
    return counts


def select_heavy_recent(scores: torch.Tensor, heavy: int, recent: int) -> torch.Tensor:
    """Per head, the last `recent` positions and the `heavy` best-scored earlier ones, sorted. scores: [..., L]."""
    length = scores.shape[-1]
    older = length - recent
    tail = torch.arange(older, length, device=scores.device).expand(*scores.shape[:-1], -1)
    if heavy == 0:
        return tail
    top = scores[..., :older].topk(heavy, dim=-1).indices
    return torch.cat([top.sort(dim=-1).values, tail], dim=-1)


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
    a row's slots must hold, its heads sharing them. adaptive: a head's floor and every other head's share of the
    layer (kvpress's most; adakv's, round((1 - alpha) x H x heavy + floor), is never more). pyramid: 2 x heavy and
    what kvlib's schedule's rounding adds, at most one token a layer (pyramidkv's first layer keeps at most
    2 x heavy)."""
    if allocation == "adaptive":
        floor = int(alpha * heavy)
        return min(older, floor + heads * (heavy - floor))
    if allocation == "pyramid":
        return min(older, 2 * heavy + layers)
    return heavy
