"""The full cache against lm-eval's own `hf` model on the paper's six tasks, for each embedded model: the same items,
the same checked files, kvlib under the one-pass protocol (the harnesses' way, unmasked for the full cache). Each
item's correctness should agree and each choice's log-likelihood match to fp32's summing error; where one does not,
the row says which.

    python benchmarks/hf_paper_tasks.py --limit 4
    python benchmarks/hf_paper_tasks.py --models qwen2.5-coder-1.5b --limit 4   # after `make install-large-models`

Writes benchmarks/results/hf_paper_tasks.json (tests/evaluation/test_paper_tasks.py holds SmolLM2's at 2 items in CI).
"""

from __future__ import annotations

import argparse
import json
import time

from smoke import results_path, sized

SIX = ["piqa", "hellaswag", "winogrande", "copa", "openbookqa", "boolq"]


def compare(model: str, limit: int) -> dict:
    from lm_eval.api.registry import get_model

    from kvlib.evaluation import KVLibLM
    from kvlib.evaluation.tasks import evaluate
    from kvlib.models import load_model, resolve_model_path

    start = time.perf_counter()
    ours = evaluate(KVLibLM(policy="full", loaded=load_model(model, device="cpu"), protocol="one_pass"), SIX,
                    limit=limit)
    hf = get_model("hf")(pretrained=resolve_model_path(model), dtype="float32", device="cpu", batch_size=1)
    theirs = {(r["task"], r["doc_id"]): r for r in evaluate(hf, SIX, limit=limit)}
    tasks = {}
    for row in ours:
        other = theirs[(row["task"], row["doc_id"])]
        a, b = json.loads(row["choice_logliks"]), json.loads(other["choice_logliks"])
        t = tasks.setdefault(row["task"], {"items": 0, "kvlib_correct": 0, "hf_correct": 0, "disagree": 0,
                                           "max_loglik_diff": 0.0})
        t["items"] += 1
        t["kvlib_correct"] += int(row["correct"])
        t["hf_correct"] += int(other["correct"])
        t["disagree"] += int((row["correct"], row.get("correct_norm")) != (other["correct"], other.get("correct_norm")))
        t["max_loglik_diff"] = max(t["max_loglik_diff"], max(abs(x - y) for x, y in zip(a, b)))
    return {"model": model, "limit": limit, "seconds": time.perf_counter() - start, "tasks": tasks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=sized(["smollm2-135m", "qwen2.5-coder-0.5b"], ["smollm2-135m"]))
    parser.add_argument("--limit", type=int, default=sized(4, 1))
    args = parser.parse_args()
    out = []
    for model in args.models:
        out.append(compare(model, args.limit))
        for task, t in out[-1]["tasks"].items():
            print(f"{model} {task}: kvlib {t['kvlib_correct']}/{t['items']}, hf {t['hf_correct']}/{t['items']}, "
                  f"{t['disagree']} disagree, max |loglik diff| {t['max_loglik_diff']:.2e}", flush=True)
    path = results_path("hf_paper_tasks.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(path.read_text()) if path.exists() else []
    kept = [r for r in previous if r["model"] not in args.models]  # one run a model, the latest
    path.write_text(json.dumps(kept + out, indent=1) + "\n")


if __name__ == "__main__":
    main()
