"""RULER through lm-eval's own tasks: built offline, answered by the `kvlib` model as by lm-eval's `hf` model."""

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from kvlib.errors import UserError
from kvlib.evaluation import KVLibLM
from kvlib.evaluation.ruler import OFFLINE_RULER_TASKS, evaluate_ruler, lengths_for, punkt_tab_dir
from kvlib.models import resolve_model_path
from kvlib.report.accuracy import figures as accuracy_figures
from kvlib.report.accuracy import lines as accuracy_page
from kvlib.report.accuracy import tables as accuracy_tables

# a fresh process, the network refused and nltk.download forbidden: every offline subtask builds its items
BUILD_OFFLINE = r"""
import json, socket, sys

def refuse(*args, **kwargs):
    raise OSError("the network is refused in this test")

socket.socket.connect = socket.create_connection = socket.getaddrinfo = refuse
import nltk

def no_download(*args, **kwargs):
    raise AssertionError(f"nltk.download{args} was called")

nltk.download = no_download
from kvlib.evaluation.ruler import OFFLINE_RULER_TASKS, task_manager

built = {}
for task in OFFLINE_RULER_TASKS:
    docs = task_manager(sys.argv[1], int(sys.argv[2])).load([task])["tasks"][task].dataset["test"]
    built[task] = {"items": len(docs), "lengths": sorted({d["max_length"] for d in docs}),
                   "longest": max(d["length"] for d in docs),
                   "answers_in_input": all(all(a in d["input"] for a in d["outputs"]) for d in docs),
                   "first": docs[0]["input"][:200]}
print(json.dumps(built))
"""


@pytest.mark.model
@pytest.mark.slow
def test_the_offline_subtasks_build_without_network(smollm, tmp_path):
    env = {**os.environ, "KVLIB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", BUILD_OFFLINE, resolve_model_path("smollm2-135m"), "1024"], env=env,
                         capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    built = json.loads(run.stdout.strip().splitlines()[-1])
    assert sorted(built) == sorted(OFFLINE_RULER_TASKS)
    for task, b in built.items():
        # 500 items each (lm-eval's count), all sized for 1,024 tokens (prompt + the tokens left for the answer)
        # lm-eval's generators aim at the length and may overshoot a little (ruler_fwe: 1,074 tokens at 1,024)
        assert b["items"] == 500 and b["lengths"] == [1024] and b["longest"] <= 1.1 * 1024, (task, b)
        assert b["answers_in_input"], task
    assert (tmp_path / "nltk_data" / "tokenizers" / "punkt_tab" / "english" / "done").exists()


def test_punkt_tab_is_written_as_nltk_reads_it(tmp_path, monkeypatch):
    import nltk
    from nltk.tokenize.punkt import PunktTokenizer
    from punkt.data import load_module

    monkeypatch.setenv("KVLIB_CACHE", str(tmp_path))
    monkeypatch.setattr(nltk.data, "path", list(nltk.data.path))  # restored afterwards
    root = punkt_tab_dir()
    assert root == tmp_path / "nltk_data" and nltk.data.path[0] == str(root)
    params = PunktTokenizer("english")._params
    english = load_module("english")
    assert params.abbrev_types == set(english.ABBREV_TYPES) and len(params.abbrev_types) > 100
    assert params.sent_starters == set(english.SENT_STARTERS)
    assert params.collocations == set(english.COLLOCATIONS)
    assert dict(params.ortho_context) == dict(english.ORTHO_CONTEXT)
    text = "Mr. Smith met Dr. Jones in Washington on Jan. 5. They talked until 3 p.m. and left."
    assert nltk.sent_tokenize(text) == ["Mr. Smith met Dr. Jones in Washington on Jan. 5.",
                                        "They talked until 3 p.m. and left."]


@pytest.mark.model
@pytest.mark.slow
def test_kvlib_full_answers_each_item_as_lm_eval_hf_does(smollm):
    """Same items, same generated strings, same scores: a short length, a handful of items, two generators."""
    from lm_eval.api.registry import get_model

    path = resolve_model_path("smollm2-135m")
    hf = get_model("hf")(pretrained=path, dtype="float32", device="cpu", batch_size=1)
    ours = KVLibLM(policy="full", loaded=smollm)
    for task, length, settings in (("niah_single_1", 512, {"max_gen_toks": 24}), ("ruler_vt", 1024, {})):
        a = evaluate_ruler(ours, task, path, [length], items=3, **settings)
        b = evaluate_ruler(hf, task, path, [length], items=3, **settings)
        assert len(a) == len(b) == 3
        assert [r["target"] for r in a] == [r["target"] for r in b]  # the same items
        assert [r["response"] for r in a] == [r["response"] for r in b]
        assert [r["ruler_score"] for r in a] == [r["ruler_score"] for r in b]
        assert all(r["kv_share_attended"] == 1.0 for r in a)


@pytest.mark.model
@pytest.mark.slow
def test_a_budget_acts_while_the_answer_is_generated(tiny):
    path = resolve_model_path("smollm2-135m")  # the tiny model has SmolLM2's tokenizer
    full = evaluate_ruler(KVLibLM(policy="full", loaded=tiny), "niah_single_1", path, [512], items=2, max_gen_toks=16)
    whole = evaluate_ruler(KVLibLM(policy="h2o", budget=1.0, loaded=tiny), "niah_single_1", path, [512], items=2,
                           max_gen_toks=16)
    small = evaluate_ruler(KVLibLM(policy="h2o", budget=0.1, loaded=tiny), "niah_single_1", path, [512], items=2,
                           max_gen_toks=16)
    assert [r["response"] for r in whole] == [r["response"] for r in full]
    assert whole[0]["kv_share_attended"] == pytest.approx(1.0)
    assert small[0]["kv_share_attended"] < 0.2
    assert [r["response"] for r in small] != [r["response"] for r in full]


def test_lengths_come_from_the_profile_for_all_subtasks_or_each():
    assert lengths_for("ruler_vt", [512, 1024]) == [512, 1024]
    assert lengths_for("ruler_vt", {"ruler_vt": [512], "niah_single_1": [2048]}) == [512]
    with pytest.raises(UserError, match="ruler_cwe.*no max_seq_lengths"):
        lengths_for("ruler_cwe", {"ruler_vt": [512]})


def test_bad_ruler_settings_are_clear_errors(tiny):
    lm = KVLibLM(policy="full", loaded=tiny)
    with pytest.raises(UserError, match="unknown RULER subtask 'vt'"):
        evaluate_ruler(lm, "vt", "unused", [512])
    with pytest.raises(UserError, match="needs its lengths"):
        evaluate_ruler(lm, "ruler_vt", "unused")
    with pytest.raises(UserError, match="exceeds the model's context"):
        evaluate_ruler(lm, "ruler_vt", "unused", [lm.max_length + 1])
    with pytest.raises(UserError, match="ruler_vt' needs max_seq_lengths of at least 1024"):
        evaluate_ruler(lm, "ruler_vt", "unused", [512])


def _rows(policy, budget, task, scores, length=512):
    return [{"task": task, "policy": policy, "budget": budget, "length": length, "ruler_score": s,
             "kv_share_attended": 1.0 if budget is None else budget} for s in scores]


def test_ruler_table_scores_each_subtask_and_their_mean():
    df = pd.DataFrame(_rows("full", None, "niah_single_1", [1, 1, 1, 1]) + _rows("full", None, "ruler_vt", [0.6, 0.4])
                      + _rows("h2o", 0.1, "niah_single_1", [0, 1, 0, 0]) + _rows("h2o", 0.1, "ruler_vt", [0.2, 0.2])
                      + [{"task": "kvlib_recall", "policy": "full", "budget": None, "correct": 1.0, "length": 40}])
    table = accuracy_tables.ruler_table(df).set_index(["task", "policy", "budget"])
    assert table.loc[("niah_single_1", "full", 1.0), "score"] == 1.0
    assert table.loc[("ruler_vt", "h2o", 0.1), "score"] == pytest.approx(0.2)
    assert table.loc[("mean", "full", 1.0), "score"] == pytest.approx((1.0 + 0.5) / 2)  # subtasks weigh the same
    assert table.loc[("mean", "h2o", 0.1), "score"] == pytest.approx((0.25 + 0.2) / 2)
    assert table.loc[("mean", "h2o", 0.1), "items"] == 6
    low, high = table.loc[("niah_single_1", "h2o", 0.1), ["low", "high"]]
    assert low < 0.25 < high
    assert list(accuracy_tables.accuracy_table(df)["task"]) == ["kvlib_recall"]  # RULER's rows stay out of it
    lines = accuracy_page.lines(df, gate=0.5)  # ruler_vt's full cache scores 50 %: the default gate would leave it out
    assert any("RULER at 512 tokens" in line and "full cache 75.0%" in line for line in lines)
    # the score is the mean of the subtasks' means; the change is read over the items pooled (stats.paired_drop)
    assert any("budget 0.1: h2o 22.5% (-60.0 pp" in line for line in lines)


def test_ruler_figure_draws_a_panel_per_length():
    df = pd.DataFrame([row for length in (512, 1024) for row in
                       _rows("full", None, "niah_single_1", [1, 1], length) + _rows("h2o", 0.1, "niah_single_1", [0, 1],
                                                                                    length)
                       + _rows("h2o", 0.5, "niah_single_1", [1, 1], length)])


    fig = accuracy_figures.ruler(accuracy_tables.ruler_table(df))
    assert [ax.get_title() for ax in fig.axes] == ["512 tokens", "1,024 tokens"]
    assert np.allclose(fig.axes[0].lines[-1].get_ydata(), 1.0)  # the full cache's reference line
