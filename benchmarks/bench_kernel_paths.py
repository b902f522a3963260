"""The decode attention kernel on each vector path this CPU runs (csrc/vectors.h: AVX-512's 16 floats, AVX2's 8, a
portable 4; kvlib.kernels.library.X86_PATHS builds each), side by side in one process: the same inputs, the C entry
point called directly (no wrapper: its checks cost the same on every path), rounds in alternating path order, each
path's median over rounds of its fastest call in the round, and each path's time as a ratio to the default build's
(-march=native). The shape is SmolLM2-135M's (9 query heads over 3 KV heads, head dim 64) at batch 16, 1,024 tokens a
row in a per-row cache.

    python benchmarks/bench_kernel_paths.py --threads 1 --rounds 15

Writes benchmarks/results/kernel_paths.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from smoke import results_path, sized

from kvlib.kernels import cpu_kernel, library

BATCH, KV_HEADS, GROUP, DIM = sized(16, 2), 3, 3, 64
TOKENS = sized(1024, 64)


def call(lib, inputs: dict):
    """The C decode over a per-row cache, every argument made once (what cpu_kernel.decode hands it)."""
    q, k, v, out, partial, lengths, offsets, table = (inputs[n] for n in ("q", "k", "v", "out", "partial", "lengths",
                                                                          "offsets", "table"))
    args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), offsets.data_ptr(), table.data_ptr(), 1, 0, 1,
            lengths.data_ptr(), TOKENS, k.stride(1), k.numel(), BATCH, KV_HEADS, GROUP, DIM, DIM ** -0.5,
            partial.data_ptr(), -(-TOKENS // lib.chunk), None, None, -1, None)

    def run():
        code = lib.decode_attention(*args)
        assert code == 0, code
    return run


def measure(libs: dict, rounds: int, calls: int) -> tuple[list[dict], dict]:
    """Each library's decode times over the same inputs, rounds in alternating order: (rows, every round's time)."""
    torch.manual_seed(0)
    inputs = {"q": torch.randn(BATCH, KV_HEADS * GROUP, DIM), "k": torch.randn(BATCH, KV_HEADS, TOKENS, DIM),
              "v": torch.randn(BATCH, KV_HEADS, TOKENS, DIM), "out": torch.empty(BATCH, KV_HEADS * GROUP, DIM),
              "lengths": torch.full((BATCH, KV_HEADS), TOKENS), "table": torch.zeros(BATCH, 1, dtype=torch.int64),
              "partial": torch.empty(cpu_kernel.workspace_bytes(BATCH, KV_HEADS, GROUP, DIM, TOKENS, False) // 4)}
    inputs["offsets"] = torch.arange(BATCH) * inputs["k"].stride(0)
    runs = {name: call(lib, inputs) for name, lib in libs.items()}
    outputs = {}
    for name, run in runs.items():  # warm up, and keep each path's output: the bits agree where the rounding does
        run()
        outputs[name] = inputs["out"].clone()
    times = {name: [] for name in runs}
    order = list(runs)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            best = float("inf")
            for _ in range(calls):
                start = time.perf_counter()
                runs[name]()
                best = min(best, time.perf_counter() - start)
            times[name].append(best)
    median = {name: statistics.median(t) for name, t in times.items()}
    first = order[0]
    rows = [{"path": name, "built for": library.describe(libs[name]), "median_us": round(median[name] * 1e6, 1),
             "min_us": round(min(times[name]) * 1e6, 1), "max_us": round(max(times[name]) * 1e6, 1),
             f"ratio_to_{first}": round(median[name] / median[first], 3),
             f"same_bits_as_{first}": torch.equal(outputs[name], outputs[first])} for name in runs]
    for row in rows:
        print(f"{row['path']:>13} {row['built for']:<36} {row['median_us']:9.1f} us  x{row[f'ratio_to_{first}']:.2f}"
              f"  same bits: {row[f'same_bits_as_{first}']}")
    return rows, times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=sized(15, 2))
    parser.add_argument("--calls", type=int, default=sized(20, 2), help="calls a round; the fastest counts")
    args = parser.parse_args(argv)
    if not cpu_kernel.available():
        raise SystemExit("no C kernels here (no compiler, or KVLIB_CPU_KERNELS=torch)")
    torch.set_num_threads(args.threads)
    libs = {"default": cpu_kernel._library()}
    if platform.machine() in ("x86_64", "AMD64"):
        libs |= {path: library.load(library.build(target)) for path, target in library.X86_PATHS.items()
                 if library.runs_here(target)}
    rows, times = measure(libs, args.rounds, args.calls)
    result = {"shape": {"batch": BATCH, "kv_heads": KV_HEADS, "group": GROUP, "head_dim": DIM, "tokens": TOKENS},
              "threads": args.threads, "rounds": args.rounds, "calls_a_round": args.calls,
              "cpu": library.cpu_lines(Path("/proc/cpuinfo").read_text()).split("\n")[0] if platform.system() == "Linux"
              else platform.processor(), "rows": rows, "times_s": times}
    out = results_path("kernel_paths.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
