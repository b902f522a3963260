"""kvlib's decode-attention kernel for CPUs (csrc/decode_attention.c), built on first use and called through ctypes.

PyTorch's CPU flash kernel pays ~60-90 us of fixed work a call and splits work by query blocks, which a decode step
(one query a row) leaves nearly empty; the C kernel reads each row's keys and values where they lie, through a block
table, in jobs of 256 tokens a KV head, and vectorizes the dot products, the exp and the weighted sum of values
(book/methods.md, "The engine"). It is compiled with the machine's C compiler (`cc`, OpenMP; ~1 s) into the kvlib
cache, keyed by its source, flags and CPU, so a machine builds it once. It links the same libgomp soname torch loads,
so its threads are torch's OpenMP pool (torch.set_num_threads holds for it): no second runtime.

Where it cannot be built (no compiler), or KVLIB_DECODE_KERNEL=torch, `available()` is False and callers attend with
PyTorch's kernels, which give the same result within fp32 rounding (tests/test_cpu_kernel.py).
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
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from kvlib.paths import cache_dir

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]
LIBS = ["-lm"]
KERNEL_ENV = "KVLIB_DECODE_KERNEL"  # "torch": never use the C kernel


def _cpu() -> str:
    """The CPU's model and features: -march=native builds for this one."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(dict.fromkeys(line for line in lines if line.startswith(("model name", "flags"))))


def _build() -> Path:
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(FLAGS + LIBS).encode(),
                                     platform.machine().encode(), _cpu().encode()])).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"decode_attention-{key}.so"
    if not target.exists():
        compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
        if not compiler[0]:
            raise RuntimeError("no C compiler (cc) found")
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, then renamed: concurrent builds
            built = Path(tmp) / target.name                           # (Ray workers) never load a half-written file
            subprocess.run([*compiler, *FLAGS, "-o", str(built), str(SOURCE), *LIBS], check=True, capture_output=True,
                           text=True)
            os.replace(built, target)
    return target


@cache
def _library() -> ctypes.CDLL | None:
    if platform.system() != "Linux":
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        warnings.warn(f"kvlib's C decode-attention kernel could not be built ({detail}); decode attends with PyTorch's "
                      f"kernels instead", RuntimeWarning, stacklevel=3)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.decode_attention.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, i64,
                                     ctypes.c_float, ptr, i64]
    lib.decode_attention.restype = None
    limits = [i64() for _ in range(4)]
    lib.decode_attention_limits(*map(ctypes.byref, limits))
    lib.chunk, lib.max_group, lib.max_dim, lib.lanes = (x.value for x in limits)
    return lib


def available() -> bool:
    """Whether decode attention on the CPU runs kvlib's C kernel (built now if it has not been)."""
    return os.environ.get(KERNEL_ENV, "") != "torch" and _library() is not None


def supports(device, dtype: torch.dtype, group: int, head_dim: int) -> bool:
    """Whether decode steps of this shape run the kernel: fp32 on a CPU, within its limits (group: query heads per KV
    head)."""
    if torch.device(device).type != "cpu" or dtype != torch.float32 or not available():
        return False  # (a GPU run never builds it)
    lib = _library()
    return group <= lib.max_group and head_dim <= lib.max_dim and head_dim % lib.lanes == 0


def workspace_bytes(batch: int, kv_heads: int, group: int, head_dim: int, max_tokens: int) -> int:
    """The scratch one call holds: each job's softmax max, sum and weighted values."""
    return batch * kv_heads * -(-max_tokens // _library().chunk) * group * (head_dim + 2) * 4


@dataclass
class DecodePlan:
    """A decode step through the kernel: each row's length once the step's token is in (int64), and the scratch one
    layer's call holds."""

    lengths: torch.Tensor
    workspace_bytes: int


def plan_decode(spec, device, start: torch.Tensor) -> DecodePlan | None:
    """The kernel's plan for a decode step whose rows hold start[b] tokens before it, for a model of this spec (its
    dtype, heads, head dim) on this device; None where PyTorch's kernels attend instead."""
    group = spec.num_attention_heads // spec.num_kv_heads
    if not supports(device, spec.dtype, group, spec.head_dim):
        return None
    lengths = start + 1
    return DecodePlan(lengths, workspace_bytes(len(start), spec.num_kv_heads, group, spec.head_dim, int(lengths.max())))


def paged_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                 lengths: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """query [B, Hq, 1, D] over a head-major block pool keys/values [Hkv, slots, D], row b over the first lengths[b]
    tokens of its block table table[b] (int64, [B, blocks])."""
    offsets = torch.zeros(len(lengths), dtype=torch.int64)
    return _call(query, keys, values, offsets, table, lengths, block_size, keys.shape[1] * keys.shape[2], scale)


def rows_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor,
                lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """query [B, Hq, 1, D] over a contiguous per-row cache keys/values [N, Hkv, capacity, D], query row b over cache
    row rows[b]'s first lengths[b] tokens (rows, lengths: int64): no copy of the rows, whichever they are."""
    capacity = keys.shape[2]
    offsets = rows * keys[0].numel()
    table = torch.zeros(len(rows), 1, dtype=torch.int64)  # a row's cache is one block of `capacity` tokens
    return _call(query, keys, values, offsets, table, lengths, capacity, capacity * keys.shape[3], scale)


def _call(query, keys, values, row_offset, table, lengths, block_size, head_stride, scale):
    """Token t of row b, KV head h, lies at element row_offset[b] + h x head_stride + (table[b, t // block_size] x
    block_size + t % block_size) x D of keys (and values). Returns [B, Hq, 1, D]."""
    lib = _library()
    b, hq, _, d = query.shape
    kv_heads = keys.shape[-3]
    for t in (keys, values, row_offset, table, lengths):
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("the C decode kernel takes contiguous CPU tensors")
    if not (keys.dtype == values.dtype == query.dtype == torch.float32
            and row_offset.dtype == table.dtype == lengths.dtype == torch.int64):
        raise ValueError("the C decode kernel takes fp32 queries, keys and values, and int64 indices")
    query = query.contiguous()
    out = torch.empty_like(query)
    longest = int(lengths.max())
    partial = torch.empty(workspace_bytes(b, kv_heads, hq // kv_heads, d, longest) // 4)
    lib.decode_attention(query.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), row_offset.data_ptr(),
                         table.data_ptr(), table.shape[1], lengths.data_ptr(), block_size, head_stride, b, kv_heads,
                         hq // kv_heads, d, scale, partial.data_ptr(), -(-longest // lib.chunk))
    return out
