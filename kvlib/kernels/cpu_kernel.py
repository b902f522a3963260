"""kvlib's CPU kernels (csrc/), built on first use and called through ctypes: decode attention
(csrc/decode_attention.c) and a Llama layer's small ops (csrc/layer_ops.c: RMSNorm with the residual add, RoPE,
SiLU-and-multiply).

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
from dataclasses import dataclass
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
    lib.decode_attention.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, i64,
                                     ctypes.c_float, ptr, i64]
    lib.decode_attention.restype = None
    lib.add_rms_norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float]
    lib.rope.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64]
    lib.silu_mul.argtypes = [ptr, ptr, i64, i64]
    for f in (lib.add_rms_norm, lib.rope, lib.silu_mul):
        f.restype = None
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
