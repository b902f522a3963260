"""Decode throughput of every policy on the one decode attention they share, against the bytes a step must read.

Two workloads: 8 rows of 2,048-token prompts (each from other text) and 1 row of 4,096, budgeted policies at 0.3,
KIVI at its default bits. Measured as bench_decode.py measures (each policy in its own process, warmed up on the
measured prompts, decode throughput from outside the engine: (N - 1) x rows / (min wall(N) - min wall(1)), rounds in
alternating order). Per policy: tok/s (median and range over rounds), the ratio to `full`, which attention decoded
(`decode_attention`), the KV bytes a step attends (the tokens each row's heads attend, every layer, K and V), and
the bytes-read limit: rows / ((weights + KV attended) / the machine's read bandwidth), the bandwidth measured by
bench_machine.py (benchmarks/results/machine.json; run it first). `before:<policy>` runs a policy from another
checkout (BENCH_BEFORE=path) in the same rounds.

    python benchmarks/bench_machine.py && python benchmarks/bench_policy_decode.py --rounds 2

Writes benchmarks/results/policy_decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from bench_decode import MODEL, NEW_TOKENS, WALLS, spawn, summary, throughput
from smoke import SMOKE, results_path, sized

WORKLOADS = sized([(8, 2048), (1, 4096)], [(2, 24)])  # (rows, prompt tokens)
BUDGET = 0.3


def main() -> None:
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from kvlib.models import ModelSpec, load_model, resolve_model_path
    from kvlib.models.workloads import mixed_length_prompts
    from kvlib.policies import available, policy_settings

    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", nargs="+", default=None, help="policies (default: every registered one)")
    parser.add_argument("--rounds", type=int, default=sized(2, 1))
    args = parser.parse_args()
    engines = args.engines or sized(available(), ["full", "h2o", "quest"])
    names = {e.removeprefix("before:") for e in engines}
    settings = {p: {"budget": BUDGET} if "budget" in policy_settings(p) else {} for p in names}
    threads = int(os.environ.get("BENCH_THREADS", os.cpu_count() or 1))
    before = os.environ.get("BENCH_BEFORE")
    machine = results_path("machine.json")
    read_gb_per_s = json.loads(machine.read_text())["read_gb_per_s"] if machine.exists() else None
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(MODEL))
    spec = ModelSpec.from_config(MODEL, AutoConfig.from_pretrained(resolve_model_path(MODEL)), torch.float32)
    weights = load_model(MODEL, device="cpu").weights_bytes  # what a step streams: the packed LM head included
    load_before = os.getloadavg()
    rows = []
    for batch, prompt_tokens in WORKLOADS:
        prompts = mixed_length_prompts(tokenizer, batch, prompt_tokens, prompt_tokens, seed=batch)
        runs: dict[str, list[dict]] = {e: [] for e in engines}
        for r in range(args.rounds):
            for name in engines if r % 2 == 0 else engines[::-1]:
                policy = name.removeprefix("before:")
                out, _ = spawn([policy], prompts, threads, before if name != policy else None, settings)
                runs[name].append({**out[policy], "tok_per_s": throughput(out[policy]["walls"], batch)})
            print(f"{batch} x {prompt_tokens} round {r}: "
                  + ", ".join(f"{e} {v[-1]['tok_per_s']:.1f}" for e, v in runs.items()), flush=True)
        full = statistics.median(run["tok_per_s"] for run in runs["full"]) if "full" in runs else None
        table = {}
        for name, rs in runs.items():
            stats = rs[-1]["stats"]
            tok_s = summary([run["tok_per_s"] for run in rs])
            attended = stats.get("kv_tokens_attended_per_step")
            kv_bytes = attended * batch * spec.kv_bytes_per_token if attended is not None else None
            limit = (batch / ((weights + kv_bytes) / (read_gb_per_s * 1e9))
                     if kv_bytes is not None and read_gb_per_s else None)
            table[name] = {"tok_per_s": tok_s, "vs_full": tok_s["median"] / full if full else None,
                           "decode_attention": stats.get("decode_attention"), "kv_bytes_attended_per_step": kv_bytes,
                           "kv_share_attended": stats.get("kv_share_attended"),
                           "kv_read_share": stats.get("kv_read_share"), "bytes_read_limit_tok_per_s": limit,
                           "walls_s": [run["walls"] for run in rs]}
        rows.append({"batch": batch, "prompt_tokens": prompt_tokens, "policies": table})
        print(markdown(rows[-1]), flush=True)
    out = results_path("policy_decode.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "method": f"decode tok/s = (new tokens {NEW_TOKENS[1]} - {NEW_TOKENS[0]}) x rows / (min wall({NEW_TOKENS[1]}) - "
                  f"min wall({NEW_TOKENS[0]})) over {WALLS} alternating timings in each process, each policy in its "
                  f"own process, {args.rounds} rounds in alternating order",
        "threads": threads, "settings": settings, "weights_bytes": weights, "read_gb_per_s": read_gb_per_s,
        "before_checkout": before, "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "smoke": SMOKE, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


def markdown(row: dict) -> str:
    lines = [f"{row['batch']} x {row['prompt_tokens']} tokens",
             "| policy | tok/s (range) | vs full | attention | KV attended / step | bytes-read limit |",
             "|---|---|---|---|---|---|"]
    for name, p in row["policies"].items():
        t = p["tok_per_s"]
        kv = f"{p['kv_bytes_attended_per_step'] / 2**20:.1f} MiB" if p["kv_bytes_attended_per_step"] else "-"
        limit = f"{p['bytes_read_limit_tok_per_s']:.1f}" if p["bytes_read_limit_tok_per_s"] else "-"
        ratio = f"{p['vs_full']:.2f}x" if p["vs_full"] else "-"
        lines.append(f"| {name} | {t['median']:.1f} ({t['min']:.1f}-{t['max']:.1f}) | {ratio} | "
                     f"{p['decode_attention']} | {kv} | {limit} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
