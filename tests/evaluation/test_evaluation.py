"""Accuracy through lm-eval: the `kvlib` model against lm-eval's own `hf` model, budgets, tasks, bad input."""

import json

import pytest
import yaml

from kvlib.errors import UserError
from kvlib.evaluation import KVLibLM
from kvlib.evaluation.tasks import evaluate, write_offline_tasks
from kvlib.models import resolve_model_path


@pytest.fixture(scope="module")
def tasks(smollm):
    return write_offline_tasks(smollm.tokenizer, recall_lengths=[40, 120], recall_items=2, recall_choices=3,
                               perplexity_docs_n=2, perplexity_tokens=48, seed=1)


def scores(rows, task):
    return [json.loads(r["choice_logliks"]) if "choice_logliks" in r else [r["loglik"]]
            for r in rows if r["task"] == task]


@pytest.mark.model
@pytest.mark.slow
def test_kvlib_full_scores_each_item_as_lm_eval_hf_does(smollm, tasks):
    from lm_eval.api.registry import get_model

    hf = get_model("hf")(pretrained=resolve_model_path("smollm2-135m"), dtype="float32", device="cpu", batch_size=1)
    names = ["kvlib_recall", "kvlib_pydoc_perplexity"]
    ours = evaluate(KVLibLM(policy="full", loaded=smollm), names, include_path=tasks)
    theirs = evaluate(hf, names, include_path=tasks)
    for task in names:
        a, b = scores(ours, task), scores(theirs, task)
        assert len(a) == len(b) > 0
        for x, y in zip(a, b):
            # a document's log-likelihood sums ~200 per-token fp32 scores: 1e-4 per item, 1e-6 of a sum
            assert x == pytest.approx(y, abs=1e-4, rel=1e-6)


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("name", ["h2o", "infinigen"])
def test_budget_one_scores_as_full_and_small_budgets_change_scores(smollm, tasks, name):
    names = ["kvlib_recall", "kvlib_pydoc_perplexity"]
    full = evaluate(KVLibLM(policy="full", loaded=smollm), names, include_path=tasks)
    # InfiniGen's budget is a cap: with every candidate admitted (alpha) it attends everything, speculation running
    every = {"alpha": 1e9} if name == "infinigen" else {}
    whole = evaluate(KVLibLM(policy=name, budget=1.0, loaded=smollm, **every), names, include_path=tasks)
    small = evaluate(KVLibLM(policy=name, budget=0.1, loaded=smollm), names, include_path=tasks)
    for task in names:
        for x, y in zip(scores(whole, task), scores(full, task)):
            assert x == pytest.approx(y, abs=1e-4, rel=1e-6)  # as against transformers' own scores, above
        changed = [max(abs(a - b) for a, b in zip(x, y)) for x, y in zip(scores(small, task), scores(full, task))]
        assert max(changed) > 1e-2


def test_offline_tasks_are_deterministic(smollm, tasks, tmp_path, monkeypatch):
    monkeypatch.setenv("KVLIB_CACHE", str(tmp_path))  # generated afresh, not found in the cache
    again = write_offline_tasks(smollm.tokenizer, recall_lengths=[40, 120], recall_items=2, recall_choices=3,
                                perplexity_docs_n=2, perplexity_tokens=48, seed=1)
    assert again != tasks and again.is_relative_to(tmp_path)
    for name in ("kvlib_recall.jsonl", "kvlib_pydoc_perplexity.jsonl"):
        assert (again / name).read_text() == (tasks / name).read_text()
    docs = [json.loads(line) for line in (tasks / "kvlib_recall.jsonl").read_text().splitlines()]
    assert [d["length"] for d in docs] == [40, 40, 120, 120]
    assert len({d["choices"][d["answer"]] for d in docs}) == len(docs)  # several facts, not one lucky string
    # the fact inside the text at its depth (tests/evaluation/test_facts.py), not always at its start
    assert all(("My " in d["context"] or "The code" in d["context"] or "Our " in d["context"])
               and len(d["choices"]) == 3 and 0 < d["depth"] < 1 for d in docs)


def test_a_local_task_shaped_like_piqa_runs(tiny, tmp_path):
    """The paper profile's tasks use lm-eval's standard configs; this stand-in has piqa's fields and templates."""
    docs = [{"goal": "To open a jar,", "sol1": "twist the lid.", "sol2": "freeze it.", "label": 0},
            {"goal": "To dry wet hands,", "sol1": "use a towel.", "sol2": "use a sponge full of water.", "label": 0}]
    (tmp_path / "piqa_local.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "piqa_local.yaml").write_text(yaml.safe_dump({
        "task": "piqa_local", "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"validation": str(tmp_path / "piqa_local.jsonl")}},
        "output_type": "multiple_choice", "validation_split": "validation",
        "doc_to_text": "Question: {{goal}}\nAnswer:", "doc_to_target": "label", "doc_to_choice": "{{[sol1, sol2]}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}))
    rows = evaluate(KVLibLM(policy="h2o", budget=0.5, loaded=tiny), ["piqa_local"], include_path=tmp_path)
    assert len(rows) == 2 and all(r["correct"] in (0.0, 1.0) and len(json.loads(r["choice_logliks"])) == 2
                                  for r in rows)


def test_an_unknown_task_is_one_clear_error(tiny, tasks):
    with pytest.raises(UserError, match="unknown lm-eval task 'hellaswagg'.*kvlib_recall"):
        evaluate(KVLibLM(policy="full", loaded=tiny), ["hellaswagg"], include_path=tasks)


def test_bad_policy_settings_fail_before_loading_a_model():
    with pytest.raises(UserError, match="no setting 'budjet'"):
        KVLibLM(policy="h2o", budjet=0.1, pretrained="/nonexistent")


@pytest.mark.slow
def test_a_hub_task_offline_says_how_to_get_its_dataset(tiny, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="Hugging Face hub"):  # (the paper's six read local files: not these)
        evaluate(KVLibLM(policy="full", loaded=tiny), ["sciq"])
