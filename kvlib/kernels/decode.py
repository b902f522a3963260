"""One decode attention for every policy: a policy says what each (row, KV head) reads, this module attends it.

A policy's whole say in decode attention is a `DecodeReads`: where its keys and values lie (a per-row cache, or a
head-major pool read through block tables, one per row or one per row and KV head) and how many tokens each (row, KV
head) reads, and whether it needs the attention probabilities summed over each KV head's query group (H2O's scores).
A row's oldest tokens may be low-bit codes (KIVI's layout, kvlib.kernels.quantized). On a CPU in fp32 kvlib's C kernel (kvlib.kernels.cpu_kernel) reads them where they lie; elsewhere (a GPU, another
dtype, no compiler, KVLIB_CPU_KERNELS=torch) one PyTorch path gathers them, padded to the longest and masked. Which
one runs depends on the machine and the model, never on the policy: a run records it (`decode_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlib.kernels import cpu_kernel
from kvlib.kernels.attention import fused_attention, matrix_attention
from kvlib.kernels.quantized import QuantizedKV, dequantize

DECODE_LENGTH_STEP = 128  # on CUDA the PyTorch path pads decode lengths to a multiple of this (padded_length)


@dataclass
class DecodeReads:
    """What each (row, KV head) of one layer's decode step reads.

    keys/values: a per-row cache [N, Hkv, capacity, D] (or a view of one: a token's D values contiguous), query row b
    reading cache row rows[b]; or, with a table, a head-major pool [Hkv, slots, D], row b reading through table[b]
    ([B, W]: one table a row) or table[b, h] ([B, Hkv, W]: one a row and KV head), block_size slots a block (1: an
    index list); with a table and rows, a per-row cache whose row rows[b] is read through table[b] (InfiniGen's
    selected entries, read in place). lengths: tokens read, [B] or [B, Hkv] (int64, on the CPU). quantized: where
    each row's oldest tokens are codes (kvlib.kernels.quantized.QuantizedKV); keys and values then hold the rest as a
    ring [N, Hkv, residual, D], token t at slot t % residual."""

    keys: torch.Tensor
    values: torch.Tensor
    lengths: torch.Tensor
    rows: torch.Tensor | None = None
    table: torch.Tensor | None = None
    block_size: int = 1
    probs: bool = False
    quantized: QuantizedKV | None = None

    def per_head_lengths(self) -> torch.Tensor:
        heads = self.keys.shape[-3]
        lengths = self.lengths if self.lengths.dim() == 2 else self.lengths[:, None].expand(-1, heads)
        return lengths.contiguous()


def kernel_for(spec, device) -> str:
    """The decode attention a model of this spec runs on this device: "c" (kvlib's C kernel) or "torch"."""
    group = spec.num_attention_heads // spec.num_kv_heads
    return "c" if cpu_kernel.supports(device, spec.dtype, group, spec.head_dim) else "torch"


def workspace_bytes(kernel: str, reads: DecodeReads, query: torch.Tensor) -> int:
    """What one call holds beside the cache: the C kernel's scratch, or the PyTorch path's gathered keys and values,
    its mask and, with probabilities, its score matrix."""
    b, hq, _, d = query.shape
    heads, longest = reads.keys.shape[-3], int(reads.lengths.max())
    if kernel == "c":
        return cpu_kernel.workspace_bytes(b, heads, hq // heads, d, longest, reads.probs)
    longest = padded_length(reads, query.device)
    in_place = reads.table is None and reads.quantized is None and _every_row(reads.keys, reads.rows)
    gathered = 0 if in_place else 2 * b * heads * longest * d * reads.keys.element_size()
    matrix = b * hq * longest * (reads.keys.element_size() + 4) if reads.probs else 0
    return gathered + b * heads * longest + matrix


def decode_attention(kernel: str, query: torch.Tensor, reads: DecodeReads, scale: float
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """query [B, Hq, 1, D] over what `reads` names. Returns (out [B, Hq, 1, D], probabilities summed over each KV
    head's group [B, Hkv, L] (L >= every length; zeros past a row's) where reads.probs, else None)."""
    if kernel == "c":
        return _c_kernel(query, reads, scale)
    return _pytorch(query, reads, scale)


def _c_kernel(query, reads: DecodeReads, scale):
    lengths = reads.per_head_lengths()
    if reads.quantized is not None:  # the residual ring is one block of `residual` slots that every block maps to
        ring = reads.keys.shape[2]
        table = torch.zeros(len(reads.rows), max(-(-int(lengths.max()) // ring), 1), dtype=torch.int64)
        return cpu_kernel.decode(query, reads.keys, reads.values, reads.rows * reads.keys.stride(0), table, lengths,
                                 ring, reads.keys.stride(1), scale, probs=reads.probs, quantized=reads.quantized,
                                 rows=reads.rows)
    if reads.table is None:  # a per-row cache (or a view of one): each row is one block of `capacity` tokens
        capacity = reads.keys.shape[2]
        offsets = reads.rows * reads.keys.stride(0)
        table = torch.zeros(len(reads.rows), 1, dtype=torch.int64)
        return cpu_kernel.decode(query, reads.keys, reads.values, offsets, table, lengths, capacity,
                                 reads.keys.stride(1), scale, probs=reads.probs)
    if reads.rows is not None:  # a per-row cache through a table: the table indexes within row rows[b]
        offsets, head_stride = reads.rows * reads.keys.stride(0), reads.keys.stride(1)
    else:  # a head-major pool
        offsets, head_stride = torch.zeros(len(lengths), dtype=torch.int64), reads.keys.stride(0)
    return cpu_kernel.decode(query, reads.keys, reads.values, offsets, reads.table, lengths, reads.block_size,
                             head_stride, scale, per_head_table=reads.table.dim() == 3, probs=reads.probs)


def padded_length(reads: DecodeReads, device) -> int:
    """The PyTorch path's padded length: the longest read, on CUDA rounded up to DECODE_LENGTH_STEP (SDPA's cuDNN
    backend builds a plan per shape, and a length growing by one a step is a new shape every step)."""
    step = DECODE_LENGTH_STEP if torch.device(device).type == "cuda" else 1
    longest = -(-int(reads.lengths.max()) // step) * step
    return min(longest, reads.keys.shape[2]) if reads.table is None and reads.quantized is None else longest


def rows_view(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """cache[rows] along dim 0: a view where rows are every row in order (the usual decode batch; indexing by a row
    tensor copies, and on a CPU that copy of a whole cache per layer costs as much as the attention), else a copy."""
    return cache if _every_row(cache, rows) else cache[rows.to(cache.device)]


def _every_row(cache: torch.Tensor, rows: torch.Tensor) -> bool:
    return len(rows) == cache.shape[0] and bool((rows == torch.arange(len(rows))).all())


def _pytorch(query, reads: DecodeReads, scale):
    b, hq = query.shape[:2]
    heads = reads.keys.shape[-3]
    device = query.device
    length = padded_length(reads, device)
    t = torch.arange(length)
    if reads.quantized is not None:
        k, v = dequantize(reads.quantized, reads.keys, reads.values, reads.rows, reads.per_head_lengths().amax(1))
        k, v = (F.pad(x, (0, 0, 0, length - x.shape[2])) for x in (k, v))
    elif reads.table is None:
        rows = slice(None) if _every_row(reads.keys, reads.rows) else reads.rows.to(device)  # a view, or a copy
        k, v = reads.keys[rows, :, :length], reads.values[rows, :, :length]
    else:
        table = reads.table if reads.table.dim() == 3 else reads.table[:, None].expand(-1, heads, -1)
        blocks = table.gather(2, (t // reads.block_size).clamp(max=table.shape[2] - 1)[None, None].expand(b, heads, -1))
        slots = (blocks * reads.block_size + t % reads.block_size).to(device)  # [B, Hkv, L]
        head = torch.arange(heads, device=device)[None, :, None]
        index = (head, slots) if reads.rows is None else (reads.rows.to(device)[:, None, None], head, slots)
        k, v = reads.keys[index], reads.values[index]
    visible = (t[None, None, :] < reads.per_head_lengths()[:, :, None]).to(device)  # [B, Hkv, L]
    if not reads.probs:
        mask = visible.repeat_interleave(hq // heads, dim=1)[:, :, None, :]
        return fused_attention(query, k, v, mask, scale), None
    out, probs = matrix_attention(query, k, v, visible[:, :, None, None, :], scale)
    return out, probs.sum(dim=(2, 3), dtype=torch.float32)
