"""FlexGen's zig-zag over a block of micro-batches, against the other way to fit a small device: smaller batches.

A batch of ROWS rows decodes with every decoder layer's weights and the whole KV cache on the host (FlexGen's
`--percent 0 100 0 100 100 0`), so every pass brings each layer's weights to the device once. Run as one block cut into
micro-batches of `gpu_batch_size` rows (kvlib.policies.flexgen), each layer's weights serve every micro-batch and the
device stages two micro-batches' cache of a layer. Run instead as separate batches of that many rows one after
another, each batch brings every layer's weights once a pass for itself. Per configuration: decode tokens/s over all
rows, the weights' bytes brought to the device per decoded token, the KV bytes per token, and the device's peak and
its staging (what the micro-batch size sets). The configurations run in turn within each round, ROUNDS rounds; the
figures are each one's median round.

    python benchmarks/bench_micro_batches.py

Writes benchmarks/results/micro_batches.json.
"""

from __future__ import annotations

import json
import os

from smoke import SMOKE, results_path, sized

MODEL = "smollm2-135m"
PERCENT = "0 100 0 100 100 0"
ROWS, PROMPT_TOKENS, NEW_TOKENS = sized(16, 4), sized(512, 24), sized(9, 3)
MICRO = sized([16, 4, 1], [4, 2])  # the first: the rows at once
ROUNDS = sized(3, 1)


def run(model, prompts, gpu_batch_size):
    from kvlib.engine import Engine
    from kvlib.policies import make_policy

    policy = make_policy("flexgen", percent=PERCENT, gpu_batch_size=gpu_batch_size)
    return Engine(model, policy).generate(prompts, NEW_TOKENS, prefill_mode="fused", stop_at_eos=False)


def measure(model, prompts, how: str, size: int) -> dict:
    """One configuration: the rows as one block of micro-batches of `size` ("block"), or as batches of `size` rows
    run one after another ("batches")."""
    from kvlib.models.offloaded_weights import decoder_layers, layer_bytes

    runs = [run(model, prompts, size)] if how == "block" else \
        [run(model, prompts[i:i + size], None) for i in range(0, len(prompts), size)]
    decode_s = sum(r.metrics["decode_s"] for r in runs)
    tokens = sum(r.metrics["decode_tokens"] for r in runs)
    weights = sum(layer_bytes(layer) for layer in decoder_layers(model.model))
    steps = sum(r.metrics["decode_steps"] for r in runs)
    kv_moved = sum(r.stats["host_to_device_bytes"] + r.stats["device_to_host_bytes"] for r in runs)
    passes = sum(len(r.outputs) + r.metrics["decode_steps"] for r in runs)  # a prefill a row, then the steps
    return {"how": how, "rows_at_once": size, "decode_s": decode_s, "decode_tokens": tokens,
            "decode_tokens_per_s": tokens / decode_s,
            "weight_bytes_per_decode_token": steps * weights / tokens,
            "kv_bytes_moved_per_token": (kv_moved - passes * weights) / sum(len(r.outputs) * NEW_TOKENS for r in runs),
            "device_peak_bytes": max(r.memory["device"]["peak_bytes"] for r in runs),
            "device_staging_bytes": max(r.memory["device"]["peak_components"].get("overhead", 0) for r in runs),
            "tokens": [o["token_ids"] for r in runs for o in r.outputs]}


def main() -> None:
    from kvlib.models import load_model
    from kvlib.models.workloads import mixed_length_prompts

    model = load_model(MODEL, device="cpu")
    prompts = mixed_length_prompts(model.tokenizer, ROWS, PROMPT_TOKENS, PROMPT_TOKENS, seed=ROWS)
    configs = [("block", m) for m in MICRO] + [("batches", m) for m in MICRO if m < ROWS]
    rounds = {c: [] for c in configs}
    for _ in range(ROUNDS):
        for how, size in configs:
            rounds[how, size].append(measure(model, prompts, how, size))
    rows = []
    for (how, size), runs in rounds.items():
        best = sorted(runs, key=lambda r: r["decode_tokens_per_s"])[len(runs) // 2]
        rows.append({**{k: v for k, v in best.items() if k != "tokens"},
                     "decode_tokens_per_s_rounds": [r["decode_tokens_per_s"] for r in runs],
                     "same_tokens_as_one_batch": best["tokens"] == rounds["block", ROWS][0]["tokens"]})
    out = results_path("micro_batches.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "method": f"{MODEL}, {ROWS} rows of {PROMPT_TOKENS} prompt tokens, {NEW_TOKENS} new tokens, flexgen at "
                  f"--percent {PERCENT}; 'block': one batch in micro-batches of rows_at_once rows; 'batches': batches "
                  f"of rows_at_once rows one after another; {ROUNDS} rounds, the configurations in turn, each one's "
                  "median round; weights' bytes per decoded token = decode passes x decoder weights / decoded tokens; "
                  "KV bytes moved per token = host<->device bytes less the weights', over every token generated",
        "load_average": os.getloadavg(), "smoke": SMOKE, "cpu_count": os.cpu_count(), "rows": rows}, indent=1) + "\n")
    for r in rows:
        print(f"{r['how']:8} {r['rows_at_once']:3}: {r['decode_tokens_per_s']:7.1f} tok/s, "
              f"{r['weight_bytes_per_decode_token'] / 2**20:7.1f} MiB weights/token, "
              f"device peak {r['device_peak_bytes'] / 2**20:7.1f} MiB (staging {r['device_staging_bytes'] / 2**20:.1f})"
              f", same tokens: {r['same_tokens_as_one_batch']}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
