"""lm-eval tasks: the project's offline ones, generated from local text, and a runner returning per-item rows.

Offline tasks (the `embedded` profile), written as ordinary lm-eval task folders (YAML + JSONL) from a seed:
- `kvlib_recall`: a fact stated inside a long stretch of real text (the CPython documentation), at a depth that
  varies (RECALL_DEPTHS), then a question about it; multiple choice among values of the same kind. Lengths up to the
  model's context; every length holds the same kinds of fact at the same depths.
- `kvlib_pydoc_perplexity`: rolling log-likelihood of stretches of the CPython documentation.
The paper's six benchmarks (piqa, hellaswag, winogrande, copa, openbookqa, boolq) are lm-eval's own tasks read from
checked local files (kvlib.evaluation.paper_tasks).
"""

from __future__ import annotations

import hashlib
import json
import random
from contextlib import contextmanager
from pathlib import Path

import yaml

from kvlib.errors import UserError
from kvlib.evaluation import paper_tasks
from kvlib.evaluation.facts import KINDS, draw
from kvlib.models.workloads import corpus_ids
from kvlib.paths import cache_dir

OFFLINE_TASKS = ("kvlib_recall", "kvlib_pydoc_perplexity")


# Where the fact sits in the recall context, as a share of the filler before it. Not at 0 alone: the first tokens are
# StreamingLLM's sinks (kept whatever the budget), and H2O's recent window keeps the last ones.
RECALL_DEPTHS = (0.1, 0.5, 0.9)


def recall_design(index: int, kinds: int, depths: int) -> tuple[int, int]:
    """(fact index, depth index) of the index-th item at one length: kinds in turn, and the depth shifted by one every
    round of kinds, so that over kinds x depths items every kind meets every depth once. Numbered within each length,
    so every length holds the same kinds at the same depths."""
    return index, (index + index // kinds) % depths


def recall_docs(tokenizer, lengths: list[int], items_per_length: int, choices: int, seed: int,
                depths: tuple[float, ...] = RECALL_DEPTHS) -> list[dict]:
    rng = random.Random(seed)
    corpus = corpus_ids(tokenizer, max(lengths) + 1)
    docs = []
    for length in lengths:
        for index in range(items_per_length):
            fact_index, depth_index = recall_design(index, len(KINDS), len(depths))
            fact, depth = draw(rng, fact_index), depths[depth_index]
            start = rng.randrange(len(corpus) - length)
            filler = corpus[start:start + length]
            cut = round(depth * length)
            before, after = tokenizer.decode(filler[:cut]), tokenizer.decode(filler[cut:])
            options = [fact.answer, *rng.sample(fact.alternatives, choices - 1)]
            rng.shuffle(options)
            context = "\n\n".join(part for part in (before, fact.statement, after) if part)
            docs.append({"context": f"{context}\n\nQuestion: {fact.question}\nAnswer:", "choices": options,
                         "answer": options.index(fact.answer), "length": length, "depth": depth})
    return docs


def perplexity_docs(tokenizer, docs: int, tokens: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    corpus = corpus_ids(tokenizer, tokens + 1)
    starts = [rng.randrange(len(corpus) - tokens) for _ in range(docs)]
    return [{"text": tokenizer.decode(corpus[s:s + tokens]), "length": tokens} for s in starts]


def _task_config(name: str, data: Path, body: dict) -> dict:
    return {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", **body}


TASK_BODIES = {
    "kvlib_recall": {"output_type": "multiple_choice", "doc_to_text": "context", "doc_to_choice": "choices",
                     "doc_to_target": "answer",
                     "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]},
    "kvlib_pydoc_perplexity": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "text",
                               "metric_list": [
                                   {"metric": m, "aggregation": a, "higher_is_better": False}
                                   for m, a in (("word_perplexity", "weighted_perplexity"),
                                                ("byte_perplexity", "weighted_perplexity"),
                                                ("bits_per_byte", "bits_per_byte"))]},
}


# Bumped whenever the generators change what they write, so that a cached folder of the old items is not reused.
TASKS_FORMAT = 2


def write_offline_tasks(tokenizer, recall_lengths: list[int], recall_items: int = 4, recall_choices: int = 4,
                        perplexity_docs_n: int = 4, perplexity_tokens: int = 256, seed: int = 0,
                        recall_depths: list[float] | None = None) -> Path:
    """Generate both offline tasks into a folder named by their settings (reused when it exists); return it."""
    depths = tuple(recall_depths or RECALL_DEPTHS)
    settings = {"recall_lengths": recall_lengths, "recall_items": recall_items, "recall_choices": recall_choices,
                "recall_depths": list(depths), "perplexity_docs": perplexity_docs_n,
                "perplexity_tokens": perplexity_tokens, "seed": seed, "tokenizer": tokenizer.name_or_path,
                "format": TASKS_FORMAT}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    folder = cache_dir() / "tasks" / key
    if (folder / "done").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    docs = {"kvlib_recall": recall_docs(tokenizer, recall_lengths, recall_items, recall_choices, seed, depths),
            "kvlib_pydoc_perplexity": perplexity_docs(tokenizer, perplexity_docs_n, perplexity_tokens, seed)}
    for name, rows in docs.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(_task_config(name, data, TASK_BODIES[name])))
    (folder / "settings.json").write_text(json.dumps(settings, indent=1))
    (folder / "done").touch()
    return folder


@contextmanager
def _without_env_report():
    """lm-eval ends every evaluation by describing the environment (torch's collect_env: `pip list` and a dozen other
    subprocesses, ~0.8 s, as long as a small unit's items), which kvlib never reads: it keeps only the samples."""
    from lm_eval import evaluator

    described = evaluator.add_env_info
    evaluator.add_env_info = lambda results: None
    try:
        yield
    finally:
        evaluator.add_env_info = described


def evaluate(lm, tasks: list[str], include_path: str | Path | None = None, limit: int | None = None) -> list[dict]:
    """Run lm-eval tasks on an LM instance; one row per item: task, doc_id, its correctness or log-likelihood.

    With include_path, only the tasks in that folder are indexed (fast, offline); without it, lm-eval's own tasks.
    """
    import lm_eval
    from lm_eval.tasks import TaskManager

    # The paper's tasks always read their checked local files, never the hub, whatever else is asked.
    paper = [t for t in tasks if t in paper_tasks.TASKS]
    folders = [str(include_path)] if include_path else []
    if paper:
        folders.append(str(paper_tasks.write_task_folder(paper)))
    all_local = include_path is not None or len(paper) == len(tasks)
    manager = TaskManager(include_path=folders or None, include_defaults=not all_local)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f"the task folder {include_path}" if include_path else "lm-eval's task index"
        raise UserError(f"unknown lm-eval task {unknown[0]!r}: not in {where}. Offline tasks: {list(OFFLINE_TASKS)} "
                        f"(generated by kvlib) and the paper's {list(paper_tasks.TASKS)} (from checked local files)")
    try:
        with _without_env_report():
            out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, log_samples=True,
                                          bootstrap_iters=0, verbosity="ERROR")
    except (ConnectionError, FileNotFoundError, OSError) as exc:  # datasets' offline errors are among these
        raise UserError(f"lm-eval task(s) {tasks} cannot load their dataset here ({type(exc).__name__}: {exc}). "
                        "Their data comes from the Hugging Face hub: run where the hub is reachable, without "
                        "HF_DATASETS_OFFLINE=1, once (it is cached after that)") from exc
    rows = []
    for task, samples in out["samples"].items():
        for sample in samples:
            row = {"task": task, "doc_id": sample["doc_id"], "length": sample["doc"].get("length"),
                   **({"depth": sample["doc"]["depth"]} if "depth" in sample["doc"] else {})}
            if task in paper_tasks.TASKS:  # what guessing scores: the validity gate reads the margin over it
                row["chance"] = paper_tasks.chance_rate(task)
            if "acc" in sample:
                scores = [float(r[0]) for r in sample["filtered_resps"]]
                row.update(correct=float(sample["acc"]), choice_logliks=json.dumps(scores), target=sample["target"])
                if "acc_norm" in sample:  # lm-eval's length-normalised choice, which it reports beside acc
                    row["correct_norm"] = float(sample["acc_norm"])
            if "word_perplexity" in sample:
                loglik, words = sample["word_perplexity"]
                row.update(loglik=float(loglik), words=int(words), bytes=int(sample["byte_perplexity"][1]))
            rows.append(row)
    return rows
