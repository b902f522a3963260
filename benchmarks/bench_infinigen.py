"""InfiniGen on the embedded model, in one process:

1. speculation quality: the share of layer i+1's true attention mass carried by the entries speculation fetched, at
   budget 0.1 / 0.3 / 0.5, with and without skewing; with alpha off (every head fetches exactly budget x cache, so the
   comparison is at equal counts) and with the default alpha = 5 (the official Llama runs'); beside each, the mass the
   oracle's best picks of the same count carry;
2. how much of the query-key product the kept columns carry (raw vs skewed basis): why skewing helps or not;
3. decode step time split into speculation / fetch / attention vs the full cache at 1K, 2K, 4K context.
Writes benchmarks/results/infinigen.json.
"""

from __future__ import annotations

import json

import torch
from smoke import results_path, sized

from kvlib.engine import Engine
from kvlib.models import load_model
from kvlib.models.workloads import prompt_of_length
from kvlib.policies import make_policy
from kvlib.policies.infinigen_skew import capture_qk, compute_skew

OUT = results_path("infinigen.json")


def column_share(model, prompt, skew) -> float:
    """Mean over layers/heads of sum_{d in kept} |q_d k_d| / sum_d |q_d k_d| on held-out text (causal pairs)."""
    queries, keys = capture_qk(model, prompt)
    group = model.spec.num_attention_heads // model.spec.num_kv_heads
    shares = []
    for layer in range(model.spec.num_layers):
        for h in range(model.spec.num_kv_heads):
            a, cols = skew.matrices[layer, h].float(), skew.columns[layer, h]
            cols = cols[cols >= 0]  # (a head keeping fewer columns than the widest is padded with -1)
            k = keys[layer][h].float() @ a
            for g in range(group):
                q = queries[layer][h * group + g].float() @ a
                prod = (q[-64:, None, :] * k[None]).abs()  # the last 64 queries against every key
                shares.append(float(prod[..., cols].sum() / prod.sum()))
    return sum(shares) / len(shares)


def main() -> None:
    model = load_model("smollm2-135m", device="cpu")
    calibration = prompt_of_length(model.tokenizer, sized(512, 64))
    held_out = prompt_of_length(model.tokenizer, sized(1024, 64), offset=50_000)
    quality = []
    for alpha in (1e9, 5.0):
        for budget in sized((0.1, 0.3, 0.5), (0.3,)):
            for skew in (True, False):
                run = Engine(model, make_policy("infinigen", budget=budget, skew=skew, alpha=alpha,
                                                measure_coverage=True)).generate([held_out], sized(16, 3),
                                                                                 stop_at_eos=False)
                quality.append({"alpha": None if alpha > 1e8 else alpha, "budget": budget, "skew": skew,
                                "coverage": run.stats["speculation_coverage"],
                                "oracle_coverage": run.stats["oracle_coverage"],
                                "kv_share_attended": run.stats["kv_share_attended"]})
                print(quality[-1])
    concentration = {name: column_share(model, held_out, compute_skew(model, calibration, 0.2, skew))
                     for name, skew in (("skewed", True), ("raw", False))}
    print(concentration)
    timing = []
    for context in sized((1024, 2048, 4096), (64,)):
        prompt = prompt_of_length(model.tokenizer, context)
        row = {"context": context}
        for name in ("full", "infinigen"):
            run = Engine(model, make_policy(name)).generate([prompt], sized(24, 3), stop_at_eos=False)
            steps = max(run.metrics["decode_steps"], 1)
            row[name] = {"decode_step_s": run.metrics["decode_step_s_mean"],
                         **{f"{k}_per_step_s": v / steps for k, v in run.metrics["sections_s"].items()},
                         "device_kv_bytes": run.memory["device"]["kv_bytes"],
                         "host_kv_bytes": run.memory["host"]["kv_bytes"], **run.stats}
        row["decode_step_ratio"] = row["infinigen"]["decode_step_s"] / row["full"]["decode_step_s"]
        timing.append(row)
        print(row)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"device": "cpu", "threads": torch.get_num_threads(), "quality": quality,
                               "kept_column_share_of_qk_product": concentration, "timing": timing}, indent=2))


if __name__ == "__main__":
    main()
