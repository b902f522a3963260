"""This machine's limits for decode, measured the way decode runs (fp32, torch's threads): what bench_decode.py's
GB/s and GFLOP/s per step are read against.

- memory read: the sum of a 512 MiB tensor (out of every cache), GB/s;
- fp32 matmul: a 2048 x 2048 by 2048 x 2048 product, GFLOP/s;
- decode-shaped matmul: 16 rows through 60 distinct prepacked 576 x 1536 linears (SmolLM2's MLP shape, 212 MB of
  weights, more than any cache), GFLOP/s and the GB/s of weights it streams.

Each is the fastest of 7 after one untimed call: a stall of the host only ever adds time. Writes
benchmarks/results/machine.json.
"""

from __future__ import annotations

import json
import os
import time

import torch
from smoke import results_path, sized

from kvlib.models.loading import PackedLinear, can_prepack

READ_MIB = sized(512, 8)
MATMUL = sized(2048, 64)
LINEARS = sized(60, 2)
ROWS = 16


def fastest(fn, times: int = 7) -> float:
    fn()
    walls = []
    for _ in range(times):
        begin = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - begin)
    return min(walls)


def main() -> None:
    threads = int(os.environ.get("BENCH_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(threads)
    x = torch.ones(READ_MIB * 2**20 // 4)
    read = x.nbytes / fastest(x.sum) / 1e9
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
    figures = {"threads": threads, "load_average": os.getloadavg(), "read_gb_per_s": read,
               "matmul_fp32_gflop_per_s": matmul,
               "decode_linears_16_rows": {"gflop_per_s": LINEARS * 2 * ROWS * 576 * 1536 / wall / 1e9,
                                          "weights_gb_per_s": LINEARS * 576 * 1536 * 4 / wall / 1e9}}
    out = results_path("machine.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
