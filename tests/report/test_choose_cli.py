"""`kvlib choose` as a user meets it (issue 65): the answer says where its rows come from and keeps to a terminal's
width; a lossy policy is never ranked by speed alone; flags out of range and unknown names are refused in one line
before anything is read; a prompt longer than every accuracy item measured is said so."""

import json

import pytest
from chooser_frames import frames

from kvlib import cli
from kvlib.report.choose.workload import choose
from kvlib.report.study_rows import StudyRows


@pytest.fixture
def profile(tmp_path, monkeypatch):
    """A profile `p` in a scratch checkout, its rows those of tests/report/test_choose.py (model and device named)."""
    from kvlib.study import results

    monkeypatch.setenv("KVLIB_ROOT", str(tmp_path))
    (tmp_path / "params").mkdir()
    (tmp_path / "params" / "p.yaml").write_text("model: smollm2-135m\nexperiments: {}\n")
    for experiment, rows in frames().items():
        results.write_unit("p", experiment, "k", 0, rows.assign(model="smollm2-135m", device="cpu"))
    return "p"


def test_the_answer_names_its_source_and_model_first_and_keeps_within_100_columns(profile, capsys):
    assert cli.main(["choose", "--profile", profile, "--prompt-tokens", "512", "--batch", "4",
                     "--output-tokens", "32", "--max-accuracy-drop", "5"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("The p profile's rows from results/p: model smollm2-135m, measured on cpu.")
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "Highest decode throughput: fast" in out


def test_json_says_the_model_profile_source_and_machine(profile, capsys):
    assert cli.main(["choose", "--profile", profile, "--prompt-tokens", "512", "--batch", "4",
                     "--output-tokens", "32", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert {k: answer[k] for k in ("model", "profile", "source", "machine")} == {
        "model": "smollm2-135m", "profile": "p", "source": "results/p", "machine": "cpu"}
    assert answer["fastest_decode"] == "fast" and answer["not_asked"] == ["sparse"]


def test_without_a_tolerance_a_lossy_policy_is_listed_apart_never_ranked_by_speed_alone():
    """At batch 8 `fast` ran out of memory: sparse (lossy) is the fastest left, yet with no accuracy asked it is not
    the answer; the regimes table's "any drop" keeps ranking it (rank_lossy, the library's default)."""
    apart = choose(StudyRows(**frames()), 512, 8, 32, rank_lossy=False)
    assert apart.fastest_decode == "full" and apart.not_asked == ["sparse"] and "sparse" not in apart.decode
    assert "Not ranked, accuracy not asked: sparse" in apart.text()
    assert choose(StudyRows(**frames()), 512, 8, 32).fastest_decode == "sparse"


@pytest.mark.parametrize(("flags", "says"), [
    (["--max-accuracy-drop", "-1"], "--max-accuracy-drop is percentage points of accuracy, 0 to 100, got -1"),
    (["--max-accuracy-drop", "250"], "0 to 100, got 250"),
    (["--max-accuracy-drop", "nan"], "0 to 100, got nan"),
    (["--hardware", "h100_sxm", "--model", "no-such-model"], "--model must be one of"),
    (["--hardware", "no-such-machine"], "--hardware must be one of"),
    (["--model", "llama-3.1-8b"], "--model goes with --hardware"),
])
def test_flags_out_of_range_and_unknown_names_are_refused_in_one_line_before_anything_is_read(
        flags, says, monkeypatch, capsys):
    def nothing_may_load(*_):
        raise AssertionError("read before the flags were checked")

    monkeypatch.setattr("kvlib.study.load_profile", nothing_may_load)
    assert cli.main(["choose", "--profile", "embedded", "--prompt-tokens", "512", "--batch", "4",
                     "--output-tokens", "32", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]


def test_a_prompt_longer_than_every_accuracy_item_is_said_so_with_the_lengths_measured():
    f = frames()
    f["accuracy"] = f["accuracy"].assign(length=512)
    longer = choose(StudyRows(**f), 2048, 4, 32, max_accuracy_drop=20.0)
    assert ("Accuracy: your 2,048-token prompt is longer than every accuracy item read (tokens, at most: recall "
            "512)") in longer.text()
    assert not any(n.startswith("Accuracy:") for n in choose(StudyRows(**f), 512, 4, 32, max_accuracy_drop=20.0).notes)


def test_the_projection_comes_first_when_another_machine_is_asked(profile, capsys):
    assert cli.main(["choose", "--profile", profile, "--prompt-tokens", "512", "--batch", "4", "--output-tokens",
                     "32", "--hardware", "h100_sxm"]) == 0
    out = capsys.readouterr().out
    assert out.index("Projected on h100_sxm") < out.index("Highest decode throughput")
