"""InfiniGen's attended share at long prompts, measured: the share of held tokens its sparse layers fetch on the
embedded model (SmolLM2-135M) at 2K, 4K and ~8K-token prompts, budget 0.3 (the paper's), alpha 5 (the official Llama
runs'). The book's own InfiniGen rows are at 64-256 and 2,048 tokens; the paper's are at 1K-10K, so the projection
(kvlib.projection.decomposition.share_sensitivity) reads this share beside them. A small model's share is still not
Llama-3.1-8B's: the label says which model and lengths.

Writes benchmarks/results/infinigen_share.json (toy sizes under KVLIB_BENCH_SMOKE=1).
"""

from __future__ import annotations

import json

import numpy as np
import torch
from smoke import results_path, sized

from kvlib.engine import Engine
from kvlib.models import load_model
from kvlib.models.workloads import prompt_of_length
from kvlib.policies import make_policy

OUT = results_path("infinigen_share.json")
MODEL = "smollm2-135m"
BUDGET = 0.3
DENSE_LAYERS = 2  # InfiniGen's first layers, kept dense: their share is 1 by construction


def main() -> None:
    model = load_model(MODEL, device="cpu")
    rows = []
    # 7,936, not 8,192: the prompt and its new tokens stay inside the model's 8K context
    for context in sized((2048, 4096, 7936), (64,)):
        prompt = prompt_of_length(model.tokenizer, context)
        run = Engine(model, make_policy("infinigen", budget=BUDGET)).generate([prompt], sized(8, 2),
                                                                              stop_at_eos=False)
        layers = run.stats["kv_share_attended_per_layer"]
        rows.append({"prompt_tokens": context, "share": float(np.mean(layers[DENSE_LAYERS:])),
                     "per_layer": layers})
        print(rows[-1]["prompt_tokens"], round(rows[-1]["share"], 3))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"model": MODEL, "budget": BUDGET, "dense_layers": DENSE_LAYERS, "device": "cpu",
                               "threads": torch.get_num_threads(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
