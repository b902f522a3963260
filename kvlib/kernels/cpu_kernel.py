"""kvlib's CPU kernels (csrc/) as Python functions: decode attention (csrc/decode_attention.c), a Llama layer's small
ops (csrc/layer_ops.c: RMSNorm with the residual add, RoPE, SiLU-and-multiply), the selections of Quest
(csrc/quest_select.c) and InfiniGen (csrc/infinigen_select.c), and KIVI's decode-step store (csrc/kivi_store.c).
Each checks what it is given first (kvlib.kernels.checks: one ValueError naming the argument) and hands the C what was
checked; the library is built and loaded by kvlib.kernels.library.

PyTorch's CPU flash kernel pays ~60-90 us of fixed work a call and splits work by query blocks, which a decode step
(one query a row) leaves nearly empty; the C kernel reads each row's keys and values where they lie, through a block
table, in jobs of 256 tokens a KV head, and vectorizes the dot products, the exp and the weighted sum of values
(book/methods.md, "The engine"). The layer ops replace six to eight PyTorch ops each, whose dispatch, not arithmetic,
is their cost at decode.

Where it cannot be built (no compiler), or KVLIB_CPU_KERNELS=torch, `available()` is False and callers use PyTorch's
ops, which give the same result within fp32 rounding (tests/kernels/test_cpu_kernel.py).
"""

from __future__ import annotations

import ctypes

import torch

from kvlib.kernels import checks
from kvlib.kernels.library import KERNEL_ENV, Quantized, available, instruction_set
from kvlib.kernels.library import library as _library

__all__ = [
    "KERNEL_ENV",
    "add_rms_norm",
    "available",
    "decode",
    "infinigen_select",
    "instruction_set",
    "kivi_store",
    "quest_select",
    "rope_",
    "runs_layer_ops",
    "silu_mul",
    "supports",
    "workspace_bytes",
]


def supports(device, dtype: torch.dtype, group: int, head_dim: int) -> bool:
    """Whether decode steps of this shape run the kernel: fp32 on a CPU, within its limits (group: query heads per KV
    head)."""
    if torch.device(device).type != "cpu" or dtype != torch.float32 or not available():
        return False  # (a GPU run never builds it)
    lib = _library()
    return group <= lib.max_group and head_dim <= lib.max_dim and head_dim % lib.lanes == 0


def workspace_bytes(batch: int, kv_heads: int, group: int, head_dim: int, max_tokens: int, probs: bool) -> int:
    """The scratch one call holds: each job's softmax max, sum and weighted values; with probabilities, each query
    head's exps and the group's sums."""
    return 4 * (_partial_floats(batch, kv_heads, group, head_dim, max_tokens)
                + (batch * kv_heads * (group + 1) * max(max_tokens, 1) if probs else 0))


def _partial_floats(batch: int, kv_heads: int, group: int, head_dim: int, max_tokens: int) -> int:
    """Each job's softmax max, sum and weighted values, [batch, kv_heads, jobs a row, group, head_dim + 2]."""
    return batch * kv_heads * -(-max_tokens // _library().chunk) * group * (head_dim + 2)


REFUSED = {-1: "a shape outside its limits (query heads per KV head <= {max_group}, head dim a multiple of {lanes} "
               "up to {max_dim}, block size >= 1)",
           -2: "lengths: a length below 0 or past its table, its workspace or its probabilities",
           -3: "table, row_offset or head_stride: a block outside the keys and values (a table entry or offset past the "
               "cache)",
           -4: "no memory for its job list",
           -5: "rows, quantized.keys_quantized or quantized.values_quantized: a quantized cache it cannot read (a "
               "row or a coded count out of range, keys coded in part of a group)"}


def decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, row_offset: torch.Tensor,
           table: torch.Tensor, lengths: torch.Tensor, block_size: int, head_stride: int, scale: float,
           per_head_table: bool = False, probs: bool = False, quantized=None, rows: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decode step's attention: query [B, Hq, 1, D]; token t of row b, KV head h at element row_offset[b] + h x
    head_stride + (tbl[t // block_size] x block_size + t % block_size) x D from keys' (and values') first element,
    tbl = table[b] ([B, W]) or table[b, h] ([B, Hkv, W], per_head_table); lengths [B, Hkv] tokens read. Keys and
    values may be views whose tokens are D contiguous floats apart (a slice of a longer cache). quantized: a
    kvlib.kernels.quantized.QuantizedKV whose codes row b reads from cache row rows[b]. Returns (out [B, Hq, 1,
    D], the probabilities summed over each KV head's group [B, Hkv, max length] where probs, else None)."""
    lib = _library()
    c = checks.check_decode(lib, query, keys, values, row_offset, table, lengths, block_size, head_stride, scale,
                            per_head_table, quantized, rows)
    b, kv_heads, d, table = len(c.lengths), c.lengths.shape[1], query.shape[-1], c.table
    out = torch.empty_like(c.query)
    partial = torch.empty(_partial_floats(b, kv_heads, c.group, d, c.longest))
    probs_width = max(c.longest, 1)  # an empty tensor's data pointer may be NULL, which the kernel reads as "no probs"
    summed = torch.empty(b, kv_heads, probs_width) if probs else None
    scratch = torch.empty(b, kv_heads, c.group, probs_width) if probs else None
    coded = None
    if c.quantized is not None:
        q, (coded_rows, keys_quantized, values_quantized, n_rows, capacity, code_bytes) = quantized, c.quantized
        coded = Quantized(q.key_codes.data_ptr(), q.value_codes.data_ptr(), q.key_scale.data_ptr(),
                          q.key_zero.data_ptr(), q.value_scale.data_ptr(), q.value_zero.data_ptr(),
                          coded_rows.data_ptr(), keys_quantized.data_ptr(), values_quantized.data_ptr(), n_rows,
                          q.bits, code_bytes, capacity, q.group, q.value_group)
    code = lib.decode_attention(c.query.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(),
                                c.row_offset.data_ptr(), table.data_ptr(), table.stride(0),
                                table.stride(1) if per_head_table else 0, table.shape[-1], c.lengths.data_ptr(),
                                c.block_size, c.head_stride, c.extent, b, kv_heads, c.group, d, c.scale,
                                partial.data_ptr(), -(-c.longest // lib.chunk), summed.data_ptr() if probs else None,
                                scratch.data_ptr() if probs else None, probs_width if probs else -1,
                                ctypes.byref(coded) if coded is not None else None)
    if code:
        reason = REFUSED.get(code, f"code {code}").format(max_group=lib.max_group, lanes=lib.lanes, max_dim=lib.max_dim)
        raise ValueError(f"decode: the C kernel refused its input: {reason}")
    return out, summed


# -- a Llama layer's small ops (csrc/layer_ops.c) ------------------------------------------------------------------------
def runs_layer_ops(x: torch.Tensor, *widths: int) -> bool:
    """Whether the layer ops below take x: a contiguous fp32 CPU tensor outside autograd (they write through
    pointers), every width a multiple of the kernels' logical vector width (`lanes`: 16 floats on every vector path)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad and x.is_contiguous()
            and available() and all(w % _library().lanes == 0 for w in widths))


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += delta (in place, where delta is given), then RMSNorm of x's rows with weight. x, delta: contiguous
    [..., n]."""
    lib = _library()
    eps = checks.check_add_rms_norm(lib, x, delta, weight, eps)
    out = torch.empty_like(x)
    n = x.shape[-1]
    _called("add_rms_norm", lib.add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(),
                                             weight.data_ptr(), out.data_ptr(), x.numel() // n, n, eps))
    return out


def rope_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Llama's RoPE, in place, on the first `heads` vectors of head_dim of each row of x [..., width] (contiguous),
    row r at cos[r], sin[r] ([..., head_dim], broadcasting over x's rows as PyTorch's rotation does)."""
    lib = _library()
    heads, head_dim, cos, sin = checks.check_rope(lib, x, heads, head_dim, cos, sin)
    width = x.shape[-1]
    _called("rope_", lib.rope(x.data_ptr(), width, cos.data_ptr(), sin.data_ptr(), x.numel() // width, heads,
                              head_dim))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) x up, gate and up the two halves of gate_up's last dimension (contiguous)."""
    lib = _library()
    n = checks.check_silu_mul(lib, gate_up)
    out = gate_up.new_empty(*gate_up.shape[:-1], n)
    _called("silu_mul", lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), out.numel() // n, n))
    return out


def _called(name: str, code: int) -> None:
    if code:
        raise ValueError(f"{name}: the C kernel refused its input's shape")


# -- Quest's block selection (csrc/quest_select.c) ---------------------------------------------------------------------
QUEST_REFUSED = {-1: "a shape outside its limits (head dim a multiple of {lanes}, block size >= 1, a table and a block "
                     "list at least one block wide)",
                 -2: "row_blocks, pages, seen or width: a row's blocks, pages or length out of range (1 <= row_blocks "
                     "<= table width, pages >= 1, min(pages, row_blocks) <= width, seen within the last block)",
                 -3: "table: an entry outside the pool (among a row's first row_blocks, or its last)",
                 -4: "no memory for its ranking"}


def quest_select(query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, table: torch.Tensor,
                 row_blocks: torch.Tensor, pages: torch.Tensor, seen: torch.Tensor, block_size: int, width: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest's selection for one layer's decode step (kvlib.policies.quest): query [B, Hq, 1, D] (or [B, Hq, D]);
    key_min, key_max [pool blocks, Hkv, D]; table [B, W] each row's blocks, the first row_blocks[b] real; pages [B]
    the blocks each KV head reads; seen [B] the tokens each row holds. Returns (block list [B, Hkv, width], chosen
    blocks in position order, then table[b, W - 1] repeated; tokens read [B, Hkv]). Indices int64 [B] / [B, W],
    contiguous CPU tensors; width >= every row's min(pages, row_blocks)."""
    lib = _library()
    c = checks.check_quest_select(lib, query, key_min, key_max, table, row_blocks, pages, seen, block_size, width)
    b, kv_heads, d = len(c.table), key_min.shape[1], query.shape[-1]
    out = torch.empty(b, kv_heads, c.width, dtype=torch.int64)
    lengths = torch.empty(b, kv_heads, dtype=torch.int64)
    code = lib.quest_select(c.query.data_ptr(), key_min.data_ptr(), key_max.data_ptr(), key_min.shape[0],
                            c.table.data_ptr(), c.table.shape[1], c.row_blocks.data_ptr(), c.pages.data_ptr(),
                            c.seen.data_ptr(), b, kv_heads, c.group, d, c.block_size, out.data_ptr(), c.width,
                            lengths.data_ptr())
    if code:
        reason = QUEST_REFUSED.get(code, f"code {code}").format(lanes=lib.lanes)
        raise ValueError(f"quest_select: the C kernel refused its input: {reason}")
    return out, lengths


# -- InfiniGen's selection (csrc/infinigen_select.c) -------------------------------------------------------------------
INFINIGEN_REFUSED = {-1: "a shape outside its limits (a table at least two wide, a cache at least two tokens long)",
                     -2: "rows, cached or cap: a row, a length or a cap out of range (0 <= rows < cache rows, 1 <= "
                         "cached < capacity, 1 <= cap < width)",
                     -4: "no memory for its scores"}


def infinigen_select(query: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, cached: torch.Tensor,
                     cap: torch.Tensor, scale: float, alpha: float, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """InfiniGen's selection for one layer's decode step (kvlib.policies.infinigen): query [B, Hkv, G, r] the skewed
    partial queries; keys [N, Hkv, r, capacity] the partial keys, token-minor; query row b reads cache row rows[b],
    its first cached[b] tokens, and fetches at most cap[b] a head. Returns (index list [B, Hkv, width]: each head's
    picks in position order, then the row's new token cached[b] repeated; picks a head [B]). Indices int64 [B],
    contiguous CPU tensors; width > every cap."""
    lib = _library()
    c = checks.check_infinigen_select(lib, query, keys, rows, cached, cap, scale, alpha, width)
    b, kv_heads, group, r = query.shape
    table = torch.empty(b, kv_heads, c.width, dtype=torch.int64)
    count = torch.empty(b, dtype=torch.int64)
    code = lib.infinigen_select(c.query.data_ptr(), keys.data_ptr(), keys.shape[0], keys.shape[3], c.rows.data_ptr(),
                                c.cached.data_ptr(), c.cap.data_ptr(), b, kv_heads, group, r, c.scale, c.alpha,
                                table.data_ptr(), c.width, count.data_ptr())
    if code:
        raise ValueError(f"infinigen_select: the C kernel refused its input: {INFINIGEN_REFUSED.get(code, f'code {code}')}")
    return table, count


# -- KIVI's decode-step store (csrc/kivi_store.c) ----------------------------------------------------------------------
def kivi_store(key: torch.Tensor, value: torch.Tensor, rows: torch.Tensor, begin: torch.Tensor,
               key_ring: torch.Tensor, value_ring: torch.Tensor, coded, residual: int) -> None:
    """KIVI's store of one layer's decode step (kvlib.policies.kivi), in place: key, value [B, Hkv, D] (each row's D x
    Hkv floats contiguous) go to cache rows `rows` holding `begin` tokens, into the rings [N, Hkv, residual, D]; the
    value each pushes out of its ring, and a key ring that fills, become codes in `coded` (a
    kvlib.kernels.quantized.QuantizedKV whose counts are not read). rows, begin: int64 [B]."""
    lib = _library()
    c = checks.check_kivi_store(lib, key, value, rows, begin, key_ring, value_ring, coded, residual)
    b, kv_heads, d = key.shape
    arrays = (key_ring, value_ring, coded.key_codes, coded.key_scale, coded.key_zero, coded.value_codes,
              coded.value_scale, coded.value_zero)
    code = lib.kivi_store(key.data_ptr(), value.data_ptr(), c.key_stride, c.value_stride, c.rows.data_ptr(),
                          c.begin.data_ptr(), b, *(x.data_ptr() for x in arrays), c.n_rows, kv_heads, d, c.residual,
                          c.capacity, coded.bits, coded.group, coded.value_group)
    if code:
        reason = {-1: "a shape outside its limits", -2: "rows or begin: a row past the cache or a length past its "
                  "capacity"}.get(code, f"code {code}")
        raise ValueError(f"kivi_store: the C kernel refused its input: {reason}")
