"""This machine's limits, measured the way kvlib's runs use it: what bench_decode.py's GB/s and GFLOP/s per step, and
the bounds of this machine's runs (kvlib.projection.bound), are read against.

On the host (always; fp32, torch's threads):
- memory read: the sum of a 512 MiB tensor (out of every cache), GB/s;
- fp32 matmul: a 2048 x 2048 by 2048 x 2048 product, GFLOP/s;
- decode-shaped matmul: 16 rows through 60 distinct prepacked 576 x 1536 linears (SmolLM2's MLP shape, 212 MB of
  weights, more than any cache), GFLOP/s and the GB/s of weights it streams;
- host copy: the 512 MiB tensor copied into another of pageable memory (what InfiniGen's fetch is where both tiers are
  host memory), GB/s of bytes copied.

On a CUDA device, where there is one (`cuda`, null where there is none):
- device memory read: the sum of a 2 GiB fp32 tensor, GB/s;
- bf16 matmul: an 8192 x 8192 by 8192 x 8192 product, TFLOP/s;
- host to device and device to host: a 1 GiB copy from and into pinned memory, GB/s; and the latency of one 4 KiB
  copy each way, issued and waited for (what a step pays per transfer beyond its bytes), microseconds.

Each is the fastest of 7 after untimed calls (a small copy's latency: of 50): a stall only ever adds time. The study
records them in results/<profile>/machine.json before it times a timed experiment's units (kvlib.study.executor:
the bounds of a profile's rows are read against the machine that measured them); benchmarks/bench_machine.py writes
them to benchmarks/results/machine.json.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvlib.models.loading import PackedLinear, can_prepack

ROWS = 16
SMALL_COPY_BYTES = 4096


@dataclass(frozen=True)
class Sizes:
    read_mib: int = 512
    matmul: int = 2048
    linears: int = 60
    device_read_mib: int = 2048
    device_matmul: int = 8192
    copy_mib: int = 1024


TOY = Sizes(8, 64, 2, 8, 256, 8)  # every measure's code path in a moment (benchmarks' smoke mode, tests)


def fastest(fn, times: int = 7, warmup: int = 1, sync=lambda: None) -> float:
    """The fastest wall of `times` calls of fn, each waited for (sync: the device's work too)."""
    for _ in range(warmup):
        fn()
    sync()
    walls = []
    for _ in range(times):
        begin = time.perf_counter()
        fn()
        sync()
        walls.append(time.perf_counter() - begin)
    return min(walls)


def host_figures(threads: int, size: Sizes) -> dict:
    torch.set_num_threads(threads)
    x = torch.ones(size.read_mib * 2**20 // 4)
    read = x.nbytes / fastest(x.sum) / 1e9
    host_copy = copy_rate(x, torch.empty_like(x))
    a, b = torch.randn(size.matmul, size.matmul), torch.randn(size.matmul, size.matmul)
    matmul = 2 * size.matmul**3 / fastest(lambda: a @ b) / 1e9
    layers = [torch.nn.Linear(576, 1536, bias=False) for _ in range(size.linears)]
    if can_prepack(layers[0]):
        layers = [PackedLinear(layer) for layer in layers]
    h = torch.randn(ROWS, 1, 576)

    def decode_linears():
        for layer in layers:
            layer(h)

    wall = fastest(torch.inference_mode()(decode_linears))
    return {"threads": threads, "load_average": os.getloadavg(), "read_gb_per_s": read,
            "matmul_fp32_gflop_per_s": matmul,
            "decode_linears_16_rows": {"gflop_per_s": size.linears * 2 * ROWS * 576 * 1536 / wall / 1e9,
                                       "weights_gb_per_s": size.linears * 576 * 1536 * 4 / wall / 1e9},
            "host_copy_gb_per_s": host_copy}


def copy_rate(source: torch.Tensor, target: torch.Tensor, sync=lambda: None) -> float:
    """GB/s of bytes copied from source into target (non_blocking, so that a pinned copy is the DMA engine's)."""
    return source.nbytes / fastest(lambda: target.copy_(source, non_blocking=True), warmup=2, sync=sync) / 1e9


def copy_latency_us(source: torch.Tensor, target: torch.Tensor) -> float:
    """One small copy issued and waited for: what a transfer costs beyond its bytes."""
    return fastest(lambda: target.copy_(source), times=50, warmup=5, sync=torch.cuda.synchronize) * 1e6


def device_read_and_matmul(size: Sizes) -> tuple[float, float]:
    """(GB/s of a sum over device memory, bf16 TFLOP/s of a square matmul); each tensor freed on return."""
    sync = torch.cuda.synchronize
    x = torch.ones(size.device_read_mib * 2**20 // 4, device="cuda")
    read = x.nbytes / fastest(x.sum, warmup=3, sync=sync) / 1e9
    a = torch.randn(size.device_matmul, size.device_matmul, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    return read, 2 * size.device_matmul**3 / fastest(lambda: a @ b, warmup=10, sync=sync) / 1e12


def cuda_figures(size: Sizes) -> dict | None:
    """The device's limits as kvlib's GPU runs meet them; None without CUDA (not measured, never 0)."""
    if not torch.cuda.is_available():
        return None
    read, matmul = device_read_and_matmul(size)
    host = torch.empty(size.copy_mib * 2**20, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    small_host, small_device = host[:SMALL_COPY_BYTES], device[:SMALL_COPY_BYTES]
    return {"device_name": torch.cuda.get_device_name(), "device_read_gb_per_s": read,
            "matmul_bf16_tflop_per_s": matmul,
            "host_to_device_pinned_gb_per_s": copy_rate(host, device, torch.cuda.synchronize),
            "device_to_host_pinned_gb_per_s": copy_rate(device, host, torch.cuda.synchronize),
            "small_copy_bytes": SMALL_COPY_BYTES,
            "host_to_device_latency_us": copy_latency_us(small_host, small_device),
            "device_to_host_latency_us": copy_latency_us(small_device, small_host)}


def measure(size: Sizes = Sizes(), threads: int | None = None) -> dict:
    """Every figure above, with the torch version and the processor."""
    threads = threads or int(os.environ.get("BENCH_THREADS", os.cpu_count() or 1))
    from kvlib.kernels.library import instruction_set

    # the C kernels' vector path: an AVX2-only CPU once ran them at an emulated 16-float width, ~10x slower
    return {**host_figures(threads, size), "cuda": cuda_figures(size), "torch_version": torch.__version__,
            "processor": platform.processor() or platform.machine(), "kernel_instruction_set": instruction_set()}


def record(path: Path, extra: dict) -> dict:
    """Measure and write the figures, with `extra` (which machine), to path."""
    figures = {**measure(), **extra}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=1))
    return figures
