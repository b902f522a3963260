"""The paper's six lm-eval benchmarks offline: lm-eval's own task definitions over checked local files, scored by the
`kvlib` model as lm-eval's `hf` model scores them."""

import json

import pytest

from kvlib.errors import UserError
from kvlib.evaluation import KVLibLM, paper_tasks
from kvlib.evaluation.tasks import evaluate
from kvlib.models import resolve_model_path

SIX = ["piqa", "hellaswag", "winogrande", "copa", "openbookqa", "boolq"]


def test_the_paper_tasks_are_its_six():
    assert sorted(paper_tasks.TASKS) == sorted(SIX)


def test_each_task_reads_lm_evals_own_definition_and_only_the_data_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLIB_CACHE", str(tmp_path))
    from lm_eval.tasks._yaml_loader import load_yaml

    folder = paper_tasks.write_task_folder(SIX)
    data_keys = {"dataset_path", "dataset_name", "dataset_kwargs", "training_split", "validation_split"}
    for name, task in paper_tasks.TASKS.items():
        ours = load_yaml(folder / f"{name}.yaml", resolve_func=False)
        theirs = load_yaml(paper_tasks.lm_eval_tasks() / task.lm_eval_yaml, resolve_func=False)
        replaced = data_keys | set(task.overrides)
        assert {k: v for k, v in ours.items() if k not in replaced} == \
            {k: v for k, v in theirs.items() if k not in replaced}, name
        assert ours["dataset_kwargs"]["data_files"]["validation"] == str(paper_tasks.checked_file(name))
        assert (task.differs != "") == bool(task.overrides), name


def test_every_item_of_each_split_loads_offline():
    import datasets

    for name, task in paper_tasks.TASKS.items():
        rows = datasets.load_dataset("arrow", data_files={"validation": str(paper_tasks.checked_file(name))})
        assert len(rows["validation"]) == task.items, name


def test_a_file_that_is_not_the_checked_one_is_refused(tmp_path, monkeypatch):
    fake = tmp_path / "data-00000-of-00001.arrow"
    fake.write_bytes(b"not the split")
    monkeypatch.setattr(paper_tasks, "_installed", lambda task: fake)
    paper_tasks.checked_file.cache_clear()
    try:
        with pytest.raises(UserError, match="is not the file kvlib checked"):
            paper_tasks.checked_file("copa")
    finally:
        paper_tasks.checked_file.cache_clear()


def test_chance_is_one_over_the_choices_and_boolqs_majority_class():
    assert [paper_tasks.chance_rate(n) for n in ("piqa", "winogrande", "copa")] == [0.5] * 3
    assert [paper_tasks.chance_rate(n) for n in ("hellaswag", "openbookqa")] == [0.25] * 2
    assert paper_tasks.chance_rate("boolq") == pytest.approx(2033 / 3270)  # "yes" in google/boolq's validation


@pytest.fixture(scope="module")
def hf_rows():
    from lm_eval.api.registry import get_model

    hf = get_model("hf")(pretrained=resolve_model_path("smollm2-135m"), dtype="float32", device="cpu", batch_size=1)
    return evaluate(hf, SIX, limit=2)


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["deployed", "one_pass"])
def test_kvlib_full_scores_the_paper_tasks_as_lm_eval_hf_does(smollm, hf_rows, protocol):
    """Under either protocol: decode steps after a dense prefill, or the harnesses' one pass (unmasked for full)."""
    ours = evaluate(KVLibLM(policy="full", loaded=smollm, protocol=protocol), SIX, limit=2)
    theirs = hf_rows
    assert sorted(r["task"] for r in ours) == sorted(r["task"] for r in theirs) == sorted(SIX * 2)
    key = {(r["task"], r["doc_id"]): r for r in theirs}
    for row in ours:
        other = key[(row["task"], row["doc_id"])]
        assert (row["correct"], row.get("correct_norm")) == (other["correct"], other.get("correct_norm"))
        assert row["chance"] == paper_tasks.chance_rate(row["task"])  # the validity gate's reference
        # a choice's log-likelihood sums its tokens' fp32 scores: BoolQ's passages run to ~250 tokens
        assert json.loads(row["choice_logliks"]) == pytest.approx(json.loads(other["choice_logliks"]), abs=1e-3)


def test_make_install_pins_the_version_whose_files_are_checked():
    from kvlib.paths import repo_root

    assert f"{paper_tasks.DISTRIBUTION}=={paper_tasks.VERSION}" in (repo_root() / "Makefile").read_text()


def test_an_evaluation_does_not_describe_the_environment_it_discards():
    """lm-eval's environment report (pip list and other subprocesses) cost each accuracy unit ~0.8 s; kvlib keeps only
    the samples, so it is skipped, and put back after."""
    from lm_eval import evaluator
    from lm_eval.api.model import LM

    class Even(LM):  # every choice equally likely: only the harness runs
        def loglikelihood(self, requests):
            return [(0.0, False)] * len(requests)

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

        def generate_until(self, requests):
            raise NotImplementedError

    described = evaluator.add_env_info
    calls = []
    evaluator.add_env_info = mine = calls.append
    try:
        rows = evaluate(Even(), ["copa"], limit=2)
        assert len(rows) == 2 and not calls
        assert evaluator.add_env_info is mine
    finally:
        evaluator.add_env_info = described
