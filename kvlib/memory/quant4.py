"""FlexGen's `--compress-cache` format (FMInference/FlexLLMGen@004ffef compression.py: 4 bits, groups of 64 along the
head dimension, asymmetric): 4-bit codes, each group's scale and minimum in fp16 stored beside its codes. Where kvlib
departs (the fidelity table's `flexgen` rows): FlexGen zero-pads the head dimension to a multiple of 64 (the zeros join the group's min-max) and
stores 15 / range; here a head narrower than 64 is one group of its own width, a wider one that is no multiple of 64
is refused, and the step range / 15 is stored (the same at head_dim 64 and 128).

A record is one vector of `dim` values (one token of one KV head) as bytes: dim/2 bytes of codes (two per byte, low
nibble first), then the groups' scales, then their minima (fp16 each), so a record sits on a tier, and moves between
tiers, as one run of bytes. A constant group has scale 0: its codes are 0 and it decodes to its minimum exactly (no
division by zero). Codes are computed from the fp16-rounded scale and minimum, the ones decoding uses, so a value comes
back within half a step of the stored scale (plus the minimum's fp16 rounding where the value sits at the minimum).
"""

from __future__ import annotations

import torch

BITS = 4
LEVELS = 2**BITS - 1
GROUP = 64


def group_size(dim: int) -> int:
    if dim % 2:
        raise ValueError(f"4-bit KV needs an even head dimension, got {dim}")
    g = min(GROUP, dim)
    if dim % g:
        raise ValueError(f"the head dimension {dim} is not a multiple of the 4-bit group size {g}")
    return g


def record_bytes(dim: int) -> int:
    return dim // 2 + 4 * (dim // group_size(dim))


def encode(x: torch.Tensor) -> torch.Tensor:
    """x [..., dim] (float) -> records [..., record_bytes(dim)] (uint8)."""
    dim = x.shape[-1]
    g = group_size(dim)
    groups = x.float().reshape(*x.shape[:-1], dim // g, g)
    low = groups.amin(dim=-1).half()
    scale = ((groups.amax(dim=-1) - low.float()) / LEVELS).half()
    step = scale.float()
    safe = torch.where(step > 0, step, torch.ones_like(step))  # a constant group: codes 0, decoded to its minimum
    codes = ((groups - low.float()[..., None]) / safe[..., None]).round_().clamp_(0, LEVELS).to(torch.uint8)
    codes = codes.reshape(*x.shape[:-1], dim)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return torch.cat([packed, scale.view(torch.uint8).reshape(*x.shape[:-1], -1),
                      low.view(torch.uint8).reshape(*x.shape[:-1], -1)], dim=-1)


def decode(records: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """records [..., record_bytes(dim)] -> values [..., dim] in dtype."""
    g = group_size(dim)
    n = dim // g
    half = dim // 2
    packed = records[..., :half]
    scale = records[..., half:half + 2 * n].contiguous().view(torch.float16).float()
    low = records[..., half + 2 * n:half + 4 * n].contiguous().view(torch.float16).float()
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*records.shape[:-1], n, g).float()
    return (codes * scale[..., None] + low[..., None]).reshape(*records.shape[:-1], dim).to(dtype)
