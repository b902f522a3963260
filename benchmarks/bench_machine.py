"""This machine's limits, measured the way kvlib's runs use it: what bench_decode.py's GB/s and GFLOP/s per step, and
the cost model's bounds for this machine, are read against.

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

Each is the fastest of 7 after untimed calls (a small copy's latency: of 50): a stall only ever adds time. Writes
benchmarks/results/machine.json, or the file `--out` names.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
from smoke import results_path, sized

from kvlib.models.loading import PackedLinear, can_prepack

READ_MIB = sized(512, 8)
MATMUL = sized(2048, 64)
LINEARS = sized(60, 2)
ROWS = 16
DEVICE_READ_MIB = sized(2048, 8)
DEVICE_MATMUL = sized(8192, 256)
COPY_MIB = sized(1024, 8)
SMALL_COPY_BYTES = 4096


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


def host_figures(threads: int) -> dict:
    torch.set_num_threads(threads)
    x = torch.ones(READ_MIB * 2**20 // 4)
    read = x.nbytes / fastest(x.sum) / 1e9
    host_copy = copy_rate(x, torch.empty_like(x))
    a, b = torch.randn(MATMUL, MATMUL), torch.randn(MATMUL, MATMUL)
    matmul = 2 * MATMUL**3 / fastest(lambda: a @ b) / 1e9
    layers = [torch.nn.Linear(576, 1536, bias=False) for _ in range(LINEARS)]
    if can_prepack(layers[0]):
        layers = [PackedLinear(layer) for layer in layers]
    h = torch.randn(ROWS, 1, 576)

    def decode_linears():
        for layer in layers:
            layer(h)

    wall = fastest(torch.inference_mode()(decode_linears))
    return {"threads": threads, "load_average": os.getloadavg(), "read_gb_per_s": read,
            "matmul_fp32_gflop_per_s": matmul,
            "decode_linears_16_rows": {"gflop_per_s": LINEARS * 2 * ROWS * 576 * 1536 / wall / 1e9,
                                       "weights_gb_per_s": LINEARS * 576 * 1536 * 4 / wall / 1e9},
            "host_copy_gb_per_s": host_copy}


def copy_rate(source: torch.Tensor, target: torch.Tensor, sync=lambda: None) -> float:
    """GB/s of bytes copied from source into target (non_blocking, so that a pinned copy is the DMA engine's)."""
    return source.nbytes / fastest(lambda: target.copy_(source, non_blocking=True), warmup=2, sync=sync) / 1e9


def copy_latency_us(source: torch.Tensor, target: torch.Tensor) -> float:
    """One small copy issued and waited for: what a transfer costs beyond its bytes."""
    return fastest(lambda: target.copy_(source), times=50, warmup=5, sync=torch.cuda.synchronize) * 1e6


def device_read_and_matmul() -> tuple[float, float]:
    """(GB/s of a sum over device memory, bf16 TFLOP/s of a square matmul); each tensor freed on return."""
    sync = torch.cuda.synchronize
    x = torch.ones(DEVICE_READ_MIB * 2**20 // 4, device="cuda")
    read = x.nbytes / fastest(x.sum, warmup=3, sync=sync) / 1e9
    a = torch.randn(DEVICE_MATMUL, DEVICE_MATMUL, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    return read, 2 * DEVICE_MATMUL**3 / fastest(lambda: a @ b, warmup=10, sync=sync) / 1e12


def cuda_figures() -> dict | None:
    """The device's limits as kvlib's GPU runs meet them; None without CUDA (not measured, never 0)."""
    if not torch.cuda.is_available():
        return None
    read, matmul = device_read_and_matmul()
    host = torch.empty(COPY_MIB * 2**20, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    small_host, small_device = host[:SMALL_COPY_BYTES], device[:SMALL_COPY_BYTES]
    return {"device_name": torch.cuda.get_device_name(), "device_read_gb_per_s": read,
            "matmul_bf16_tflop_per_s": matmul,
            "host_to_device_pinned_gb_per_s": copy_rate(host, device, torch.cuda.synchronize),
            "device_to_host_pinned_gb_per_s": copy_rate(device, host, torch.cuda.synchronize),
            "small_copy_bytes": SMALL_COPY_BYTES,
            "host_to_device_latency_us": copy_latency_us(small_host, small_device),
            "device_to_host_latency_us": copy_latency_us(small_device, small_host)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON (default: "
                        "benchmarks/results/machine.json; a temporary folder under KVLIB_BENCH_SMOKE=1)")
    args = parser.parse_args(argv)
    threads = int(os.environ.get("BENCH_THREADS", os.cpu_count() or 1))
    figures = {**host_figures(threads), "cuda": cuda_figures(), "torch_version": torch.__version__,
               "processor": platform.processor() or platform.machine()}
    out = args.out or results_path("machine.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
