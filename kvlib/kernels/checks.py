"""What each C entry point (csrc/) is given, checked before it is called: one function per entry point, which checks
every shape, dtype, device, layout, rank, range and relation the C reads and raises one ValueError naming the
argument, and returns what the C is then handed.

The C cannot see the sizes of the tensors behind its pointers, their dtypes, devices or layouts: all of that is
checked here, with every scalar (within int64 and fp32 before ctypes, which would wrap or round them silently). The
values inside index tensors (lengths, table entries, row offsets, rows, counts, pages) the C checks itself before it
reads anything, in overflow-safe arithmetic, and refuses with a code the wrapper turns into one ValueError naming
those arguments: a check in Python as well would be a dozen more small ops a layer at decode (measured: the checks
would cost more than the kernels they guard). So that what is checked is what is read, every index tensor is copied
here and the copy is what the C checks and reads: another thread writing the caller's tensor while ctypes has
released the GIL cannot change it between the check and the read.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

from kvlib.kernels.quantized import BITS, RAW_BITS

INT64_MAX = 2 ** 63 - 1
FLOAT32_MAX = 3.4028234663852886e38  # (ctypes would make a larger float inf)
ANY_RANK = frozenset(range(1, 64))


def tensor(where: str, name: str, x, dtype: torch.dtype, rank: int | tuple[int, ...] | None = None,
           shape: tuple | None = None, contiguous: bool = True) -> torch.Tensor:
    """x, a CPU tensor of dtype, of that rank (a number, or the numbers allowed) and shape (None: any size there),
    contiguous where asked. (Written for speed: the layer ops run it several times a layer at decode.)"""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{where}: {name} must be a tensor, got {type(x).__name__}")  # noqa: TRY004 (one ValueError for every misuse)
    if not x.is_cpu:
        raise ValueError(f"{where}: {name} must be on the CPU, got a tensor on {x.device}")
    if x.dtype != dtype:
        raise ValueError(f"{where}: {name} must be {dtype}, got {x.dtype}")
    if shape is not None:
        got = x.shape
        if len(got) != len(shape) or any(want is not None and g != want for g, want in zip(got, shape)):
            expected = ", ".join("*" if s is None else str(s) for s in shape)
            raise ValueError(f"{where}: {name} must have shape [{expected}], got {tuple(got)}")
    elif rank is not None and x.dim() != rank and (isinstance(rank, int) or x.dim() not in rank):
        ranks = (rank,) if isinstance(rank, int) else rank
        raise ValueError(f"{where}: {name} must have {' or '.join(map(str, ranks))} dimensions, got shape "
                         f"{tuple(x.shape)}")
    if contiguous and not x.is_contiguous():
        raise ValueError(f"{where}: {name} must be contiguous, got strides {x.stride()} for shape {tuple(x.shape)}")
    return x


def indices(where: str, name: str, x, shape: tuple) -> torch.Tensor:
    """An int64 index tensor of that shape, contiguous, copied: the copy is what the C checks and reads."""
    return tensor(where, name, x, torch.int64, shape=shape).clone()


def integer(where: str, name: str, v, low: int = -INT64_MAX - 1, high: int = INT64_MAX) -> int:
    """v as an int in [low, high] (within int64: ctypes would wrap it)."""
    if isinstance(v, bool):
        raise ValueError(f"{where}: {name} must be an integer, got {v!r}")  # noqa: TRY004 (one ValueError for every misuse)
    try:
        v = operator.index(v)
    except TypeError:
        raise ValueError(f"{where}: {name} must be an integer, got {v!r}") from None
    if not max(low, -INT64_MAX - 1) <= v <= min(high, INT64_MAX):
        raise ValueError(f"{where}: {name} must be in [{low}, {min(high, INT64_MAX)}], got {v}")
    return v


def real(where: str, name: str, v, low: float = -math.inf) -> float:
    """v as a finite float >= low, within fp32 (the C takes a float)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {name} must be a number, got {v!r}") from None
    if isinstance(v, bool) or not math.isfinite(f) or f < low or abs(f) > FLOAT32_MAX:
        raise ValueError(f"{where}: {name} must be a finite fp32 number >= {low}, got {v!r}")
    return f


def extent(x: torch.Tensor) -> int:
    """The elements from x's first that x's view can read (0 where it is empty)."""
    return 1 + sum((n - 1) * s for n, s in zip(x.shape, x.stride())) if x.numel() else 0


# -- decode attention (csrc/decode_attention.c) ------------------------------------------------------------------------
@dataclass
class DecodeArgs:
    query: torch.Tensor
    row_offset: torch.Tensor
    table: torch.Tensor
    lengths: torch.Tensor
    block_size: int
    head_stride: int
    scale: float
    extent: int
    group: int
    longest: int
    quantized: tuple | None  # (rows, keys_quantized, values_quantized, n_rows, capacity, code_bytes), copies


def check_decode(lib, query, keys, values, row_offset, table, lengths, block_size, head_stride, scale,
                 per_head_table, quantized, rows) -> DecodeArgs:
    where = "decode"
    tensor(where, "query", query, torch.float32, shape=(None, None, 1, None), contiguous=False)
    b, hq, _, d = query.shape
    if d < lib.lanes or d > lib.max_dim or d % lib.lanes:
        raise ValueError(f"{where}: query's head dim must be a multiple of {lib.lanes} up to {lib.max_dim}, got {d}")
    lengths = indices(where, "lengths", lengths, (b, None))
    kv_heads = lengths.shape[1]
    if kv_heads < 1 or hq % kv_heads or not 1 <= hq // kv_heads <= lib.max_group:
        raise ValueError(f"{where}: query's {hq} heads must be a multiple (1 to {lib.max_group} times) of the "
                         f"{kv_heads} KV heads of lengths")
    for name, x in (("keys", keys), ("values", values)):
        tensor(where, name, x, torch.float32, contiguous=False)
        if x.dim() < 2 or x.shape[-1] != d or x.stride(-1) != 1 or x.stride(-2) != d:
            raise ValueError(f"{where}: {name} must hold tokens of the query's {d} floats, contiguous and {d} apart; "
                             f"got shape {tuple(x.shape)}, strides {x.stride()}")
    if keys.shape != values.shape or keys.stride() != values.stride():
        raise ValueError(f"{where}: keys and values must have one shape and layout, got {tuple(keys.shape)} "
                         f"{keys.stride()} and {tuple(values.shape)} {values.stride()}")
    reach = extent(keys)
    block_size = integer(where, "block_size", block_size, 1)
    head_stride = integer(where, "head_stride", head_stride, 0)
    row_offset = indices(where, "row_offset", row_offset, (b,))
    table = indices(where, "table", table, (b, kv_heads, None) if per_head_table else (b, None))
    longest = max(int(lengths.max()), 0) if lengths.numel() else 0  # (the C refuses a length past its table)
    coded = None
    if quantized is not None:
        n_rows, capacity, code_bytes = check_codes(where, quantized, kv_heads, d)
        if rows is None:
            raise ValueError(f"{where}: a quantized cache needs `rows`, each query row's cache row")
        coded = (indices(where, "rows", rows, (b,)),
                 indices(where, "quantized.keys_quantized", quantized.keys_quantized, (b,)),
                 indices(where, "quantized.values_quantized", quantized.values_quantized, (b,)),
                 n_rows, capacity, code_bytes)
    return DecodeArgs(query.contiguous(), row_offset, table, lengths, block_size, head_stride,
                      real(where, "scale", scale), reach, hq // kv_heads, longest, coded)


def check_codes(where: str, q, kv_heads: int, dim: int) -> tuple[int, int, int]:
    """A QuantizedKV's arrays checked against one another and against the head dim `dim` the caller's tokens have
    (the C sizes every code and scale from it): (cache rows, capacity in tokens, code bytes a token)."""
    bits = integer(where, "quantized.bits", q.bits)
    if bits not in (*BITS, RAW_BITS):
        raise ValueError(f"{where}: quantized.bits must be one of {[*BITS, RAW_BITS]}, got {bits}")
    group = integer(where, "quantized.group", q.group, 1)
    value_group = integer(where, "quantized.value_group", q.value_group, 1)
    if group * bits % 8 or dim * bits % 8 or dim % value_group:
        raise ValueError(f"{where}: quantized.group {group} and the head dim {dim} must fill whole bytes of {bits}-bit "
                         f"codes, and quantized.value_group {value_group} divide the head dim")
    tensor(where, "quantized.value_codes", q.value_codes, torch.uint8, rank=4)
    n_rows, _, capacity, _ = q.value_codes.shape
    if capacity % group:
        raise ValueError(f"{where}: quantized.value_codes' capacity {capacity} must be whole groups of {group}")
    groups, code_bytes, raw = capacity // group, dim * bits // 8, bits == RAW_BITS
    expected = {"key_codes": ((n_rows, kv_heads, groups, dim, group * bits // 8), torch.uint8),
                "value_codes": ((n_rows, kv_heads, capacity, code_bytes), torch.uint8),
                "key_scale": ((n_rows, kv_heads, groups, 0 if raw else dim), torch.float32),
                "key_zero": ((n_rows, kv_heads, groups, 0 if raw else dim), torch.float32),
                "value_scale": ((n_rows, kv_heads, capacity, 0 if raw else dim // value_group), torch.float32),
                "value_zero": ((n_rows, kv_heads, capacity, 0 if raw else dim // value_group), torch.float32)}
    for name, (shape, dtype) in expected.items():
        tensor(where, f"quantized.{name}", getattr(q, name), dtype, shape=shape)
    return n_rows, capacity, code_bytes


# -- the layer ops (csrc/layer_ops.c) ----------------------------------------------------------------------------------
def check_add_rms_norm(lib, x, delta, weight, eps) -> float:
    where = "add_rms_norm"
    tensor(where, "x", x, torch.float32, rank=ANY_RANK)
    n = x.shape[-1]
    if n < lib.lanes or n % lib.lanes:
        raise ValueError(f"{where}: x's width must be a multiple of {lib.lanes}, got {n}")
    if delta is not None and (not isinstance(delta, torch.Tensor) or delta.shape != x.shape):
        raise ValueError(f"{where}: delta must be a tensor of x's shape {tuple(x.shape)}, got "
                         f"{tuple(delta.shape) if isinstance(delta, torch.Tensor) else type(delta).__name__}")
    if delta is not None:
        tensor(where, "delta", delta, torch.float32)
    tensor(where, "weight", weight, torch.float32, shape=(n,))
    return real(where, "eps", eps, 0.0)


def check_rope(lib, x, heads, head_dim, cos, sin) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """(heads, head_dim, cos, sin with a row for each of x's rows: broadcast where they broadcast over x's)."""
    where = "rope_"
    tensor(where, "x", x, torch.float32, rank=ANY_RANK)
    width = x.shape[-1]
    head_dim = integer(where, "head_dim", head_dim, 1)
    heads = integer(where, "heads", heads, 0)
    if head_dim % (2 * lib.lanes):
        raise ValueError(f"{where}: head_dim must be a multiple of {2 * lib.lanes}, got {head_dim}")
    if heads * head_dim > width:
        raise ValueError(f"{where}: {heads} heads of {head_dim} exceed x's width {width}")
    out, lead = [], tuple(x.shape[:-1])
    for name, c in (("cos", cos), ("sin", sin)):
        tensor(where, name, c, torch.float32, contiguous=False)
        if c.shape[:-1] == x.shape[:-1] and c.shape[-1] == head_dim:  # one row for each of x's: as it is
            out.append(c.contiguous())
            continue
        try:
            broadcast = torch.broadcast_shapes(tuple(c.shape), (*lead, head_dim))
        except RuntimeError:
            broadcast = None
        if c.dim() < 1 or c.shape[-1] != head_dim or broadcast != (*lead, head_dim):
            raise ValueError(f"{where}: {name} must be [..., {head_dim}] broadcasting over x's rows {list(lead)}, got "
                             f"{tuple(c.shape)}")
        out.append(c.expand(*lead, head_dim).contiguous())  # (a copy only where it broadcast or was a view)
    return heads, head_dim, out[0], out[1]


def check_silu_mul(lib, gate_up) -> int:
    where = "silu_mul"
    tensor(where, "gate_up", gate_up, torch.float32, rank=ANY_RANK)
    n = gate_up.shape[-1] // 2
    if gate_up.shape[-1] % 2 or n < lib.lanes or n % lib.lanes:
        raise ValueError(f"{where}: gate_up's width must be twice a multiple of {lib.lanes}, got {gate_up.shape[-1]}")
    return n


# -- Quest's and InfiniGen's selections (csrc/quest_select.c, csrc/infinigen_select.c) ---------------------------------
@dataclass
class QuestArgs:
    query: torch.Tensor
    table: torch.Tensor
    row_blocks: torch.Tensor
    pages: torch.Tensor
    seen: torch.Tensor
    block_size: int
    width: int
    group: int


def check_quest_select(lib, query, key_min, key_max, table, row_blocks, pages, seen, block_size, width) -> QuestArgs:
    where = "quest_select"
    tensor(where, "query", query, torch.float32, rank=(3, 4), contiguous=False)
    if query.dim() == 4 and query.shape[2] != 1:
        raise ValueError(f"{where}: query must hold one token a head, [B, Hq, 1, D], got {tuple(query.shape)}")
    b, hq, d = query.shape[0], query.shape[1], query.shape[-1]
    if d < lib.lanes or d % lib.lanes:
        raise ValueError(f"{where}: query's head dim must be a multiple of {lib.lanes}, got {d}")
    tensor(where, "key_min", key_min, torch.float32, shape=(None, None, d))
    tensor(where, "key_max", key_max, torch.float32, shape=tuple(key_min.shape))
    kv_heads = key_min.shape[1]
    if kv_heads < 1 or hq % kv_heads or hq == 0:
        raise ValueError(f"{where}: query's {hq} heads must be a multiple of key_min's {kv_heads} KV heads")
    block_size = integer(where, "block_size", block_size, 1, 2 ** 31 - 1)
    table = indices(where, "table", table, (b, None))
    w = table.shape[1]
    if not 1 <= w <= 2 ** 31 - 1:
        raise ValueError(f"{where}: table must be 1 to 2^31 - 1 blocks wide, got {w}")
    width = integer(where, "width", width, 1, 2 ** 40)  # (the C refuses one below a row's picks)
    return QuestArgs(query.contiguous(), table, indices(where, "row_blocks", row_blocks, (b,)),
                     indices(where, "pages", pages, (b,)), indices(where, "seen", seen, (b,)), block_size, width,
                     hq // kv_heads)


@dataclass
class InfinigenArgs:
    query: torch.Tensor
    rows: torch.Tensor
    cached: torch.Tensor
    cap: torch.Tensor
    scale: float
    alpha: float
    width: int


def check_infinigen_select(lib, query, keys, rows, cached, cap, scale, alpha, width) -> InfinigenArgs:
    where = "infinigen_select"
    tensor(where, "query", query, torch.float32, rank=4, contiguous=False)
    b, kv_heads, group, r = query.shape
    if min(kv_heads, group, r) < 1:
        raise ValueError(f"{where}: query [B, Hkv, G, r] needs at least one head, query a head and channel, got "
                         f"{tuple(query.shape)}")
    tensor(where, "keys", keys, torch.float32, shape=(None, kv_heads, r, None))
    capacity = keys.shape[3]
    if not 2 <= capacity <= 2 ** 31 - 1:
        raise ValueError(f"{where}: keys' capacity must be 2 to 2^31 - 1 tokens, got {capacity}")
    width = integer(where, "width", width, 2, 2 ** 40)
    return InfinigenArgs(query.contiguous(), indices(where, "rows", rows, (b,)), indices(where, "cached", cached, (b,)),
                         indices(where, "cap", cap, (b,)), real(where, "scale", scale),
                         real(where, "alpha", alpha), width)


# -- KIVI's store (csrc/kivi_store.c) ----------------------------------------------------------------------------------
@dataclass
class KiviArgs:
    rows: torch.Tensor
    begin: torch.Tensor
    key_stride: int
    value_stride: int
    n_rows: int
    capacity: int
    residual: int


def check_kivi_store(lib, key, value, rows, begin, key_ring, value_ring, coded, residual) -> KiviArgs:
    where = "kivi_store"
    tensor(where, "key", key, torch.float32, rank=3, contiguous=False)
    b, kv_heads, d = key.shape
    if kv_heads < 1 or d < 1:
        raise ValueError(f"{where}: key [B, Hkv, D] needs a KV head and a channel, got {tuple(key.shape)}")
    strides = []
    for name, x in (("key", key), ("value", value)):
        tensor(where, name, x, torch.float32, shape=(b, kv_heads, d), contiguous=False)
        row_stride = x.stride(0) if b > 1 else kv_heads * d  # (a dimension of one has any stride)
        if not x[:1].is_contiguous() or row_stride < kv_heads * d:
            raise ValueError(f"{where}: {name}'s rows must each hold their {kv_heads} x {d} floats contiguous, got "
                             f"strides {x.stride()}")
        strides.append(row_stride)
    n_rows, capacity, _ = check_codes(where, coded, kv_heads, d)
    residual = integer(where, "residual", residual, coded.group, capacity)
    if residual % coded.group or capacity % residual:
        raise ValueError(f"{where}: residual {residual} must be whole groups of {coded.group} and divide the "
                         f"capacity {capacity}")
    for name, x in (("key_ring", key_ring), ("value_ring", value_ring)):
        tensor(where, name, x, torch.float32, shape=(n_rows, kv_heads, residual, d))
    return KiviArgs(indices(where, "rows", rows, (b,)), indices(where, "begin", begin, (b,)), strides[0], strides[1], n_rows, capacity, residual)
