"""Decode throughput of every policy on the one decode attention they share, against the bytes a step must read.

Two workloads: 8 rows of 2,048-token prompts (each from other text) and 1 row of 4,096, budgeted policies at 0.3,
KIVI at its default bits. Each policy runs in its own process, in alternating order over rounds. A process prefills
the rows once (each in the policy's preferred prefill mode), then decodes them together, and the caller times each
decode step around `Session.decode` (nothing inside the engine times itself); the first WARM steps are untimed (the
first call of each matmul shape builds oneDNN's primitive). Decode throughput = rows / median step time; its range
is the steps' interquartile range, over every round. Why not bench_decode.py's whole-call walls: at 8 x 2,048 each
prefill is ~30 s on 2 cores against ~2 s for 32 decode steps, so a 1 % wobble of the prefill in wall(N) - wall(1)
moved the figure by ~15 % (one round: `paged` 100.8 against `full` 138.4 tok/s, the two within 1 % of each other
at batch 16 in bench_decode.py).

Per policy: tok/s, the ratio to `full`, which attention decoded (`decode_attention`), the KV bytes a step attends (the
tokens each row's heads attend, every layer, K and V), and the bytes-read limit: rows / ((weights + KV attended) /
the machine's read bandwidth), the bandwidth as bench_machine.py measures it, in this run.

    python benchmarks/bench_policy_decode.py --rounds 2
    BENCH_BEFORE=/path/to/old/checkout python benchmarks/bench_policy_decode.py --engines full before:full --workload 8x2048

`before:<policy>` runs the policy from another kvlib checkout (its own worker, in its own process), in the same run and
the same alternating order: a change's before and after as ratios from one run.

Writes benchmarks/results/policy_decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from smoke import SMOKE, results_path, sized

MODEL = "smollm2-135m"
WORKLOADS = sized([(8, 2048), (1, 4096)], [(2, 24)])  # (rows, prompt tokens)
STEPS = sized(32, 3)  # timed decode steps
WARM = sized(3, 1)  # untimed decode steps first
BUDGET = 0.3
STATS = ("decode_attention", "kv_tokens_attended_per_step", "kv_share_attended", "kv_read_share")


def one_run(policy: str, batch: int, prompt_tokens: int, threads: int) -> dict:
    import torch

    from kvlib.engine import Engine
    from kvlib.models import load_model
    from kvlib.models.workloads import mixed_length_prompts
    from kvlib.policies import make_policy, policy_settings

    torch.set_num_threads(threads)
    model = load_model(MODEL, device="cpu")
    prompts = mixed_length_prompts(model.tokenizer, batch, prompt_tokens, prompt_tokens, seed=batch)
    chosen = make_policy(policy, **({"budget": BUDGET} if "budget" in policy_settings(policy) else {}))
    engine = Engine(model, chosen)
    rows = list(range(batch))
    steps = []
    with engine.session([len(p) for p in prompts], WARM + STEPS + 1) as session, torch.inference_mode():
        tokens = [int(session.prefill(r, p, chosen.preferred_prefill).argmax()) for r, p in enumerate(prompts)]
        for i in range(WARM + STEPS):
            begin = time.perf_counter()
            logits = session.decode(rows, tokens)
            tokens = logits.argmax(-1).tolist()
            if i >= WARM:
                steps.append(time.perf_counter() - begin)
        stats = {**chosen.usage.summary(), **chosen.stats(), "decode_attention": chosen.decode_kernel}
    return {"policy": policy, "settings": chosen.settings(), "step_s": steps,
            "stats": {k: stats.get(k) for k in STATS}, "weights_bytes": weights_read(model),
            "kv_bytes_per_token": model.spec.kv_bytes_per_token}


def weights_read(model) -> int:
    """The weights a decode step reads: every matrix once (a tied head's packed copy instead of the embedding table,
    from which a step looks up one row a token)."""
    embedding = model.model.get_input_embeddings().weight
    return model.weights_bytes + model.packed_copy_bytes - (embedding.nbytes if model.packed_copy_bytes else 0)


def read_bandwidth(threads: int) -> float:
    """GB/s of a 512 MiB sum, the fastest of 7, as bench_machine.py measures it: the limit's denominator, this run."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(sized(512, 8) * 2**20 // 4)
    x.sum()
    best = min(_timed(x.sum) for _ in range(7))
    return x.nbytes / best / 1e9


def _timed(fn) -> float:
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def main() -> None:
    from kvlib.policies import available

    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", nargs="+", default=None, help="policies (default: every registered one)")
    parser.add_argument("--rounds", type=int, default=sized(2, 1))
    parser.add_argument("--workload", default=None, help="only this one, ROWSxTOKENS (e.g. 8x2048)")
    args = parser.parse_args()
    workloads = [tuple(map(int, args.workload.split("x")))] if args.workload else WORKLOADS
    before = Path(os.environ.get("BENCH_BEFORE", "/work/main"))
    engines = args.engines or sized(available(), ["full", "h2o", "quest"])
    threads = int(os.environ.get("BENCH_THREADS", os.cpu_count() or 1))
    load_before = os.getloadavg()
    bandwidth = read_bandwidth(threads)
    rows = []
    for batch, prompt_tokens in workloads:
        runs: dict[str, list[dict]] = {e: [] for e in engines}
        for r in range(args.rounds):
            for name in engines if r % 2 == 0 else engines[::-1]:
                old = name.startswith("before:")
                script = before / "benchmarks" / Path(__file__).name if old else Path(__file__)
                out = subprocess.run([sys.executable, str(script), "--worker", name.removeprefix("before:"), str(batch),
                                      str(prompt_tokens), str(threads)], capture_output=True, text=True, check=False,
                                     env={**os.environ, "PYTHONPATH": str(script.parents[1])})
                if out.returncode != 0:
                    raise RuntimeError(f"{name} failed:\n{out.stderr[-3000:]}")
                runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"{batch} x {prompt_tokens} round {r}: " + ", ".join(
                f"{e} {batch / statistics.median(v[-1]['step_s']):.1f}" for e, v in runs.items() if v), flush=True)
        rows.append(summarize(batch, prompt_tokens, runs, bandwidth))
        print(markdown(rows[-1]), flush=True)
    out = results_path("policy_decode.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "method": f"each policy in its own process, {args.rounds} rounds in alternating order; per process one prefill, "
                  f"{WARM} untimed decode steps, then {STEPS} decode steps each timed around Session.decode; tok/s = "
                  "rows / median step (range: the steps' interquartile range over every round)",
        "threads": threads, "budget": BUDGET, "read_gb_per_s": bandwidth, "load_average_before": load_before,
        "load_average_after": os.getloadavg(), "smoke": SMOKE, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


def summarize(batch: int, prompt_tokens: int, runs: dict[str, list[dict]], bandwidth: float) -> dict:
    def tok_s(rs):
        steps = sorted(s for run in rs for s in run["step_s"])
        q1, median, q3 = statistics.quantiles(steps, n=4) if len(steps) > 1 else steps * 3
        return {"median": batch / median, "low": batch / q3, "high": batch / q1,
                "rounds": [batch / statistics.median(run["step_s"]) for run in rs]}

    full = tok_s(runs["full"])["median"] if "full" in runs else None
    table = {}
    for name, rs in runs.items():
        first, t = rs[0], tok_s(rs)
        attended = first["stats"]["kv_tokens_attended_per_step"]
        kv = attended * batch * first["kv_bytes_per_token"] if attended is not None else None
        table[name] = {"settings": first["settings"], "tok_per_s": t, "vs_full": t["median"] / full if full else None,
                       "decode_attention": first["stats"]["decode_attention"], "kv_bytes_attended_per_step": kv,
                       "kv_share_attended": first["stats"]["kv_share_attended"],
                       "kv_read_share": first["stats"]["kv_read_share"],
                       "bytes_read_limit_tok_per_s": batch / ((first["weights_bytes"] + kv) / (bandwidth * 1e9))
                       if kv is not None else None,
                       "step_s": [run["step_s"] for run in rs]}
    return {"batch": batch, "prompt_tokens": prompt_tokens, "policies": table}


def markdown(row: dict) -> str:
    lines = [f"{row['batch']} x {row['prompt_tokens']} tokens",
             "| policy | tok/s (IQR) | vs full | attention | KV attended / step | bytes-read limit (tok/s) |",
             "|---|---|---|---|---|---|"]
    for name, p in row["policies"].items():
        t = p["tok_per_s"]
        kv = f"{p['kv_bytes_attended_per_step'] / 2**20:.1f} MiB" if p["kv_bytes_attended_per_step"] else "-"
        limit = f"{p['bytes_read_limit_tok_per_s']:.1f}" if p["bytes_read_limit_tok_per_s"] else "-"
        ratio = f"{p['vs_full']:.2f}x" if p["vs_full"] else "-"
        lines.append(f"| {name} | {t['median']:.1f} ({t['low']:.1f}-{t['high']:.1f}) | {ratio} | "
                     f"{p['decode_attention']} | {kv} | {limit} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        name, batch, prompt_tokens, threads = sys.argv[2], *map(int, sys.argv[3:6])
        print(json.dumps(one_run(name, batch, prompt_tokens, threads)))
    else:
        main()
