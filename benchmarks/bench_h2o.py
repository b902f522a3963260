"""H2O (budget 0.3) vs the full cache: decode step time and KV bytes at 1K, 2K, 4K context, in one process.

Also the kept-set overlap of chunked prefill with the full-prefill kept set, for cross-chunk accumulation and for
the per-chunk scoring the paper measured. Writes benchmarks/results/h2o.json.
"""

from __future__ import annotations

import json

import torch
from smoke import results_path, sized

from kvlib.engine import Engine
from kvlib.models import load_model
from kvlib.models.workloads import prompt_of_length
from kvlib.policies import make_policy

OUT = results_path("h2o.json")
NEW_TOKENS = sized(32, 4)


def kept_after_prefill(model, prompt, mode, chunk, scoring):
    policy = make_policy("h2o", budget=0.3, chunk_scoring=scoring)
    kept = {}
    compact = policy._compact

    def capture(row):
        compact(row)
        kept.update({layer: policy.kept_positions(layer, row) for layer in range(model.spec.num_layers)})

    policy._compact = capture
    Engine(model, policy).generate([prompt], 1, prefill_mode=mode, chunk_size=chunk)
    return kept


def overlap(a, b) -> float:
    pairs = [(x, y) for layer in a for x, y in zip(a[layer], b[layer])]
    return sum(len(x & y) for x, y in pairs) / sum(len(x) for x, _ in pairs)


def main() -> None:
    model = load_model("smollm2-135m", device="cpu")
    rows = []
    for context in sized((1024, 2048, 4096), (64,)):
        prompt = prompt_of_length(model.tokenizer, context)
        result = {}
        for name, settings, mode in (("full", {}, "fused"), ("h2o", {"budget": 0.3}, "chunked")):
            run = Engine(model, make_policy(name, **settings)).generate([prompt], NEW_TOKENS, prefill_mode=mode,
                                                                        chunk_size=512, stop_at_eos=False)
            result[name] = {"decode_step_s": run.metrics["decode_step_s_mean"],
                            "kv_bytes": run.memory["device"]["kv_bytes"],
                            "cache_ops_s": run.metrics["wall_split_s"]["cache_ops"]}
        rows.append({"context": context, **result,
                     "kv_bytes_ratio": result["h2o"]["kv_bytes"] / result["full"]["kv_bytes"],
                     "decode_step_ratio": result["h2o"]["decode_step_s"] / result["full"]["decode_step_s"]})
        print(rows[-1])
    prompt = prompt_of_length(model.tokenizer, sized(2048, 64))
    reference = kept_after_prefill(model, prompt, "full", 0, "accumulate")
    chunks = {}
    for chunk in sized((256, 512, 1024), (16,)):
        chunks[chunk] = {scoring: overlap(kept_after_prefill(model, prompt, "chunked", chunk, scoring), reference)
                         for scoring in ("accumulate", "per_chunk")}
        print(chunk, chunks[chunk])
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"device": "cpu", "threads": torch.get_num_threads(), "new_tokens": NEW_TOKENS,
                               "rows": rows, "kept_set_overlap_with_full_prefill_2048": chunks}, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
