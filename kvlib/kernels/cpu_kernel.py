"""kvlib's CPU kernels (csrc/), built on first use and called through ctypes: decode attention
(csrc/decode_attention.c), a Llama layer's small ops (csrc/layer_ops.c: RMSNorm with the residual add, RoPE,
SiLU-and-multiply), the selections of Quest (csrc/quest_select.c) and InfiniGen (csrc/infinigen_select.c), and KIVI's
decode-step store (csrc/kivi_store.c).

PyTorch's CPU flash kernel pays ~60-90 us of fixed work a call and splits work by query blocks, which a decode step
(one query a row) leaves nearly empty; the C kernel reads each row's keys and values where they lie, through a block
table, in jobs of 256 tokens a KV head, and vectorizes the dot products, the exp and the weighted sum of values
(book/methods.md, "The engine"). The layer ops replace six to eight PyTorch ops each, whose dispatch, not arithmetic,
is their cost at decode. The sources are compiled with the machine's C compiler (`cc`, OpenMP; ~1 s) into one library
in the kvlib cache, keyed by the sources, flags and CPU, so a machine builds it once. It links the same libgomp soname
torch loads, so its threads are torch's OpenMP pool (torch.set_num_threads holds for it): no second runtime.

Where it cannot be built (no compiler), or KVLIB_CPU_KERNELS=torch, `available()` is False and callers use PyTorch's
ops, which give the same result within fp32 rounding (tests/test_cpu_kernel.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import warnings
from functools import cache
from pathlib import Path

import torch

from kvlib.paths import cache_dir

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.[ch]"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]
LIBS = ["-lm"]
KERNEL_ENV = "KVLIB_CPU_KERNELS"  # "torch": never use the C kernels


def _cpu() -> str:
    """The CPU's model and features: -march=native builds for this one."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(dict.fromkeys(line for line in lines if line.startswith(("model name", "flags"))))


def _build() -> Path:
    key = hashlib.sha256(b"\0".join([*(p.read_bytes() for p in SOURCES), " ".join(FLAGS + LIBS).encode(),
                                     platform.machine().encode(), _cpu().encode()])).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"kvlib_cpu-{key}.so"
    if not target.exists():
        compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
        if not compiler[0]:
            raise RuntimeError("no C compiler (cc) found")
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, then renamed: concurrent builds
            built = Path(tmp) / target.name                           # (Ray workers) never load a half-written file
            sources = [str(p) for p in SOURCES if p.suffix == ".c"]
            subprocess.run([*compiler, *FLAGS, "-o", str(built), *sources, *LIBS], check=True, capture_output=True,
                           text=True)
            os.replace(built, target)
    return target


class _Quantized(ctypes.Structure):
    """csrc/decode_attention.c's `quantized`: where rows' oldest tokens are codes (kvlib.kernels.quantized)."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("key_codes", "value_codes", "key_scale", "key_zero",
                                                     "value_scale", "value_zero", "rows", "keys_quantized",
                                                     "values_quantized")] + \
               [(name, ctypes.c_int64) for name in ("n_rows", "bits", "code_bytes", "capacity", "group", "value_group")]


@cache
def _library() -> ctypes.CDLL | None:
    if platform.system() != "Linux":
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        warnings.warn(f"kvlib's C kernels could not be built ({detail}); the engine uses PyTorch's ops instead",
                      RuntimeWarning, stacklevel=3)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.decode_attention.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ptr, i64, i64, i64, i64, i64, i64,
                                     i64, ctypes.c_float, ptr, i64, ptr, ptr, i64, ctypes.POINTER(_Quantized)]
    lib.decode_attention.restype = ctypes.c_int
    lib.add_rms_norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float]
    lib.rope.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64]
    lib.silu_mul.argtypes = [ptr, ptr, i64, i64]
    for f in (lib.add_rms_norm, lib.rope, lib.silu_mul):
        f.restype = None
    lib.quest_select.argtypes = [ptr, ptr, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, ptr, i64, ptr]
    lib.quest_select.restype = ctypes.c_int
    lib.infinigen_select.argtypes = [ptr, ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_float,
                                     ctypes.c_float, ptr, i64, ptr]
    lib.infinigen_select.restype = ctypes.c_int
    lib.kivi_store.argtypes = [ptr, ptr, i64, i64, ptr, ptr, i64, *[ptr] * 8, *[i64] * 8]
    lib.kivi_store.restype = ctypes.c_int
    limits = [i64() for _ in range(4)]
    lib.decode_attention_limits(*map(ctypes.byref, limits))
    lib.chunk, lib.max_group, lib.max_dim, lib.lanes = (x.value for x in limits)
    return lib


def available() -> bool:
    """Whether the engine on a CPU runs kvlib's C kernels (built now if they have not been)."""
    return os.environ.get(KERNEL_ENV, "") != "torch" and _library() is not None


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
           -2: "a length below 0 or past its table, its workspace or its probabilities",
           -3: "a block outside the keys and values (a table entry or offset past the cache)",
           -4: "no memory for its job list",
           -5: "a quantized cache it cannot read (bits, code width, groups, a row or a coded count out of range, "
               "keys coded in part of a group)"}


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
    b, hq, _, d = query.shape
    kv_heads = lengths.shape[1]
    for x in (row_offset, table, lengths):
        if not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError("the C decode kernel takes contiguous CPU tensors")
    for x in (keys, values):
        if x.device.type != "cpu" or x.stride(-1) != 1 or (x.dim() > 1 and x.stride(-2) != d):
            raise ValueError("the C decode kernel takes CPU keys and values whose tokens are contiguous, D floats "
                             "apart")
    if not (keys.dtype == values.dtype == query.dtype == torch.float32
            and row_offset.dtype == table.dtype == lengths.dtype == torch.int64):
        raise ValueError("the C decode kernel takes fp32 queries, keys and values, and int64 indices")
    if keys.shape != values.shape or keys.stride() != values.stride() or hq % kv_heads or lengths.shape[0] != b \
            or len(row_offset) != b or table.shape[:1 + per_head_table] != (b, kv_heads)[:1 + per_head_table]:
        raise ValueError(f"the C decode kernel got mismatched shapes: query {tuple(query.shape)}, keys "
                         f"{tuple(keys.shape)}, values {tuple(values.shape)}, lengths {tuple(lengths.shape)}, "
                         f"table {tuple(table.shape)}, row offsets {tuple(row_offset.shape)}")
    # the elements from the first one that the kernel may read: what its bounds check holds every read within
    extent = 1 + sum((n - 1) * s for n, s in zip(keys.shape, keys.stride())) if keys.numel() else 0
    query = query.contiguous()
    out = torch.empty_like(query)
    longest = int(lengths.max()) if lengths.numel() else 0
    group, width = hq // kv_heads, table.shape[-1]
    partial = torch.empty(_partial_floats(b, kv_heads, group, d, longest))
    probs_width = max(longest, 1)  # an empty tensor's data pointer may be NULL, which the kernel reads as "no probs"
    summed = torch.empty(b, kv_heads, probs_width) if probs else None
    scratch = torch.empty(b, kv_heads, group, probs_width) if probs else None
    coded = _quantized_args(quantized, rows, b, kv_heads, d) if quantized is not None else None
    code = lib.decode_attention(query.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(),
                                row_offset.data_ptr(), table.data_ptr(), table.stride(0),
                                table.stride(1) if per_head_table else 0, width, lengths.data_ptr(), block_size,
                                head_stride, extent, b, kv_heads, group, d, scale, partial.data_ptr(),
                                -(-longest // lib.chunk), summed.data_ptr() if probs else None,
                                scratch.data_ptr() if probs else None, probs_width if probs else -1,
                                ctypes.byref(coded) if coded is not None else None)
    if code:
        reason = REFUSED.get(code, f"code {code}").format(max_group=lib.max_group, lanes=lib.lanes, max_dim=lib.max_dim)
        raise ValueError(f"the C decode kernel refused its input: {reason}")
    return out, summed


def _quantized_args(q, rows: torch.Tensor, batch: int, kv_heads: int, dim: int) -> _Quantized:
    """The kernel's view of a QuantizedKV, its tensors checked against one another (the kernel checks the counts)."""
    n_rows, capacity, code_bytes = _checked_codes(q, kv_heads)
    for x in (rows, q.keys_quantized, q.values_quantized):
        if x is None or tuple(x.shape) != (batch,) or x.dtype != torch.int64 or not x.is_contiguous():
            raise ValueError("the C decode kernel takes quantized rows and counts as contiguous int64 [batch] tensors")
    return _Quantized(q.key_codes.data_ptr(), q.value_codes.data_ptr(), q.key_scale.data_ptr(), q.key_zero.data_ptr(),
                      q.value_scale.data_ptr(), q.value_zero.data_ptr(), rows.data_ptr(), q.keys_quantized.data_ptr(),
                      q.values_quantized.data_ptr(), n_rows, q.bits, code_bytes, capacity, q.group, q.value_group)


def _checked_codes(q, kv_heads: int) -> tuple[int, int, int]:
    """A QuantizedKV's arrays checked against one another: (cache rows, capacity in tokens, code bytes a token)."""
    n_rows, _, capacity, code_bytes = q.value_codes.shape
    scales = q.key_scale.shape[-1]
    value_groups = q.value_scale.shape[-1]
    dim = code_bytes * 8 // q.bits
    groups = capacity // q.group
    expected = {"key_codes": (n_rows, kv_heads, groups, dim, q.group * q.bits // 8),
                "value_codes": (n_rows, kv_heads, capacity, code_bytes),
                "key_scale": (n_rows, kv_heads, groups, scales), "key_zero": (n_rows, kv_heads, groups, scales),
                "value_scale": (n_rows, kv_heads, capacity, value_groups),
                "value_zero": (n_rows, kv_heads, capacity, value_groups)}
    for name, shape in expected.items():
        x = getattr(q, name)
        dtype = torch.uint8 if name.endswith("codes") else torch.float32
        if tuple(x.shape) != shape or x.dtype != dtype or not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError(f"kvlib's C kernels got a quantized {name} {tuple(x.shape)} {x.dtype}; expected a "
                             f"contiguous CPU {dtype} tensor {shape}")
    return n_rows, capacity, code_bytes


# -- a Llama layer's small ops (csrc/layer_ops.c) ------------------------------------------------------------------------
def runs_layer_ops(x: torch.Tensor, *widths: int) -> bool:
    """Whether the layer ops below take x: a contiguous fp32 CPU tensor outside autograd (they write through
    pointers), every width a multiple of the vector width."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad and x.is_contiguous()
            and available() and all(w % _library().lanes == 0 for w in widths))


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += delta (in place, where delta is given), then RMSNorm of x's rows with weight. x, delta: contiguous
    [..., n]."""
    out = torch.empty_like(x)
    n = x.shape[-1]
    _library().add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                            out.data_ptr(), x.numel() // n, n, eps)
    return out


def rope_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Llama's RoPE, in place, on the first `heads` vectors of head_dim of each row of x [..., width] (contiguous),
    row r at cos[r], sin[r] ([..., head_dim], contiguous)."""
    width = x.shape[-1]
    _library().rope(x.data_ptr(), width, cos.data_ptr(), sin.data_ptr(), x.numel() // width, heads, head_dim)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) x up, gate and up the two halves of gate_up's last dimension (contiguous)."""
    n = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], n)
    _library().silu_mul(gate_up.data_ptr(), out.data_ptr(), out.numel() // n, n)
    return out


# -- Quest's block selection (csrc/quest_select.c) ---------------------------------------------------------------------
QUEST_REFUSED = {-1: "a shape outside its limits (head dim a multiple of {lanes}, block size >= 1, a table and a block "
                     "list at least one block wide)",
                 -2: "a row's blocks, pages or length out of range (1 <= blocks <= table width, pages >= 1, picks "
                     "within the block list, the length within the last block)",
                 -3: "a table entry outside the pool",
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
    if query.dim() not in (3, 4) or key_min.dim() != 3:
        raise ValueError(f"Quest's C selection takes a query [B, Hq, (1,) D] and key bounds [blocks, Hkv, D], got "
                         f"{tuple(query.shape)} and {tuple(key_min.shape)}")
    b, hq, d = query.shape[0], query.shape[1], query.shape[-1]
    pool, kv_heads = key_min.shape[0], key_min.shape[1]
    query = query.contiguous()  # (the model's query may be a view into its fused projection)
    for x in (query, key_min, key_max, table, row_blocks, pages, seen):
        if not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError("Quest's C selection takes contiguous CPU tensors")
    if not (query.dtype == key_min.dtype == key_max.dtype == torch.float32
            and table.dtype == row_blocks.dtype == pages.dtype == seen.dtype == torch.int64):
        raise ValueError("Quest's C selection takes fp32 queries and bounds, and int64 indices")
    if key_min.shape != key_max.shape or key_min.shape[2:] != (d,) or hq % kv_heads or query.numel() != b * hq * d \
            or table.dim() != 2 or table.shape[0] != b or any(x.shape != (b,) for x in (row_blocks, pages, seen)):
        raise ValueError(f"Quest's C selection got mismatched shapes: query {tuple(query.shape)}, key bounds "
                         f"{tuple(key_min.shape)} and {tuple(key_max.shape)}, table {tuple(table.shape)}, rows "
                         f"{tuple(row_blocks.shape)}, {tuple(pages.shape)}, {tuple(seen.shape)}")
    out = torch.empty(b, kv_heads, width, dtype=torch.int64)
    lengths = torch.empty(b, kv_heads, dtype=torch.int64)
    code = lib.quest_select(query.data_ptr(), key_min.data_ptr(), key_max.data_ptr(), pool, table.data_ptr(),
                            table.shape[1], row_blocks.data_ptr(), pages.data_ptr(), seen.data_ptr(), b, kv_heads,
                            hq // kv_heads, d, block_size, out.data_ptr(), width, lengths.data_ptr())
    if code:
        reason = QUEST_REFUSED.get(code, f"code {code}").format(lanes=lib.lanes)
        raise ValueError(f"Quest's C selection refused its input: {reason}")
    return out, lengths


# -- InfiniGen's selection (csrc/infinigen_select.c) -------------------------------------------------------------------
INFINIGEN_REFUSED = {-1: "a shape outside its limits (a table at least two wide, a cache at least two tokens long)",
                     -2: "a row, a length or a cap out of range (1 <= cached < capacity, 1 <= cap < table width)",
                     -4: "no memory for its scores"}


def infinigen_select(query: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, cached: torch.Tensor,
                     cap: torch.Tensor, scale: float, alpha: float, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """InfiniGen's selection for one layer's decode step (kvlib.policies.infinigen): query [B, Hkv, G, r] the skewed
    partial queries; keys [N, Hkv, r, capacity] the partial keys, token-minor; query row b reads cache row rows[b],
    its first cached[b] tokens, and fetches at most cap[b] a head. Returns (index list [B, Hkv, width]: each head's
    picks in position order, then the row's new token cached[b] repeated; picks a head [B]). Indices int64 [B],
    contiguous CPU tensors; width > every cap."""
    lib = _library()
    query = query.contiguous()
    if query.dim() != 4 or keys.dim() != 4:
        raise ValueError(f"InfiniGen's C selection takes queries [B, Hkv, G, r] and keys [N, Hkv, r, capacity], got "
                         f"{tuple(query.shape)} and {tuple(keys.shape)}")
    b, kv_heads, group, r = query.shape
    for x in (keys, rows, cached, cap):
        if not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError("InfiniGen's C selection takes contiguous CPU tensors")
    if not (query.dtype == keys.dtype == torch.float32 and rows.dtype == cached.dtype == cap.dtype == torch.int64):
        raise ValueError("InfiniGen's C selection takes fp32 queries and keys, and int64 indices")
    if keys.shape[1:3] != (kv_heads, r) or any(x.shape != (b,) for x in (rows, cached, cap)):
        raise ValueError(f"InfiniGen's C selection got mismatched shapes: queries {tuple(query.shape)}, keys "
                         f"{tuple(keys.shape)}, rows {tuple(rows.shape)}, {tuple(cached.shape)}, {tuple(cap.shape)}")
    table = torch.empty(b, kv_heads, width, dtype=torch.int64)
    count = torch.empty(b, dtype=torch.int64)
    code = lib.infinigen_select(query.data_ptr(), keys.data_ptr(), keys.shape[0], keys.shape[3], rows.data_ptr(),
                                cached.data_ptr(), cap.data_ptr(), b, kv_heads, group, r, scale, alpha,
                                table.data_ptr(), width, count.data_ptr())
    if code:
        raise ValueError(f"InfiniGen's C selection refused its input: {INFINIGEN_REFUSED.get(code, f'code {code}')}")
    return table, count


# -- KIVI's decode-step store (csrc/kivi_store.c) ----------------------------------------------------------------------
def kivi_store(key: torch.Tensor, value: torch.Tensor, rows: torch.Tensor, begin: torch.Tensor,
               key_ring: torch.Tensor, value_ring: torch.Tensor, coded, residual: int) -> None:
    """KIVI's store of one layer's decode step (kvlib.policies.kivi), in place: key, value [B, Hkv, D] (each row's D x
    Hkv floats contiguous) go to cache rows `rows` holding `begin` tokens, into the rings [N, Hkv, residual, D]; the
    value each pushes out of its ring, and a key ring that fills, become codes in `coded` (a
    kvlib.kernels.quantized.QuantizedKV whose counts are not read). rows, begin: int64 [B]."""
    b, kv_heads, d = key.shape
    n_rows, capacity, _ = _checked_codes(coded, kv_heads)
    arrays = (key_ring, value_ring, coded.key_codes, coded.key_scale, coded.key_zero, coded.value_codes,
              coded.value_scale, coded.value_zero)  # the codes' shapes, dtypes and layout checked above
    if any(x.shape != (n_rows, kv_heads, residual, d) or x.dtype != torch.float32 or x.device.type != "cpu"
           or not x.is_contiguous() for x in (key_ring, value_ring)) \
            or any(x.shape != key.shape or x.stride(-1) != 1 or x.stride(-2) != d or x.dtype != torch.float32
                   or x.device.type != "cpu" for x in (key, value)) \
            or any(x.dtype != torch.int64 or x.shape != (b,) or x.device.type != "cpu" or not x.is_contiguous()
                   for x in (rows, begin)):
        raise ValueError("KIVI's C store takes contiguous CPU caches and rings [N, Hkv, residual, D], fp32 keys and "
                         "values [B, Hkv, D] with contiguous heads, and int64 rows and lengths [B]")
    code = _library().kivi_store(key.data_ptr(), value.data_ptr(), key.stride(0), value.stride(0), rows.data_ptr(),
                                 begin.data_ptr(), b, *(x.data_ptr() for x in arrays), n_rows, kv_heads, d, residual,
                                 capacity, coded.bits, coded.group, coded.value_group)
    if code:
        reason = {-1: "a shape outside its limits", -2: "a row or a length out of range"}.get(code, f"code {code}")
        raise ValueError(f"KIVI's C store refused its input: {reason}")
