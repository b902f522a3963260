"""A profile's schema (kvlib.study.schema): every shipped profile passes it; a malformed one fails with one error that
lists every problem at its key path, before anything loads or runs, and leaves nothing under results/."""

import copy
from pathlib import Path

import pytest
import yaml

from kvlib import cli, study
from kvlib.errors import UserError
from kvlib.study.schema import check_profile

PARAMS = Path(__file__).parents[2] / "params"
SMOKE = yaml.safe_load((PARAMS / "smoke.yaml").read_text())


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLIB_ROOT", str(tmp_path))
    (tmp_path / "params").mkdir()
    return tmp_path


@pytest.mark.parametrize("path", sorted(PARAMS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_profile_passes_the_schema(path):
    raw = yaml.safe_load(path.read_text())
    assert check_profile(copy.deepcopy(raw)) == []
    profile = study.load_profile(path.stem)
    assert all(profile.points(e) for e in profile.experiments)


def smoke(**experiments):
    """The smoke profile with parts of its experiments replaced: {experiment: {part: {key: value}}}."""
    raw = copy.deepcopy(SMOKE)
    for exp, parts in experiments.items():
        for part, values in parts.items():
            if isinstance(values, dict) and isinstance(raw["experiments"][exp].get(part), dict):
                raw["experiments"][exp][part].update(values)
            else:
                raw["experiments"][exp][part] = values
    return raw


BAD = [  # (what, profile, every problem expected, each a key path and its message)
    ("a prompt length that is not a number", smoke(ttft={"grid": {"prompt_tokens": ["abc"]}}),
     ["experiments.ttft.grid.prompt_tokens[0]: expected a positive integer, got 'abc'"]),
    ("two problems in one profile", smoke(ttft={"grid": {"prompt_tokens": [64, -3]}, "fixed": {"chunk_sise": 64}}),
     ["experiments.ttft.grid.prompt_tokens[1]: expected a positive integer, got -3",
      "experiments.ttft.fixed.chunk_sise: unknown key 'chunk_sise'"]),
    ("a prefill mode that does not exist", smoke(ttft={"grid": {"prefill": ["full", "flash"]}}),
     ["experiments.ttft.grid.prefill[1]: expected one of ['full', 'fused', 'chunked'], got 'flash'"]),
    ("a grid axis that is not a list", smoke(batch_scaling={"grid": {"batch_size": 4}}),
     ["experiments.batch_scaling.grid.batch_size: a grid axis must be a non-empty list, got 4"]),
    ("a workload value missing", smoke(decode_length={"fixed": None}),
     ["experiments.decode_length: needs 'prompt_tokens' in its grid or fixed values"]),
    ("a budget of the wrong type", smoke(accuracy={"grid": {"budget": ["half"]}}),
     [("experiments.accuracy.grid.budget[0]: expected float, got 'half' (h2o, infinigen, streaming, snapkv, quest, "
       "duo, adakv, pyramidkv, flexgen_h2o)")]),
    ("a budget out of range", smoke(retention={"grid": {"budget": [1.5]}}),
     ["experiments.retention.grid.budget[0]: budget must be in (0, 1], got 1.5"]),
    ("a setting of one policy through the runner's checks", {**smoke(), "policy_settings": {"h2o": {"budget": 0}}},
     ["policy_settings.h2o.budget: budget must be in (0, 1], got 0"]),
    ("an unknown policy setting", {**smoke(), "policy_settings": {"quest": {"pages": 3}}},
     ["policy_settings.quest.pages: unknown key 'pages'; quest's settings:"]),
    ("an unknown policy", smoke(ttft={"policies": ["full", "flashy"]}),
     ["experiments.ttft.policies: unknown key 'flashy'"]),
    ("a request rate that is not positive", smoke(serving={"grid": {"request_rate": [2.0, 0]}}),
     ["experiments.serving.grid.request_rate[1]: expected a positive number, got 0"]),
    ("an SLO that is a string", smoke(serving={"fixed": {"slo_ttft_s": "fast"}}),
     ["experiments.serving.fixed.slo_ttft_s: expected a positive number, got 'fast'"]),
    ("a bucket upside down", smoke(retention={"fixed": {"buckets": [[200, 400], [400, 100]]}}),
     ["experiments.retention.fixed.buckets[1]: expected a bucket [low, high]"]),
    ("a query turn of 0", smoke(retention={"fixed": {"query_turns": [2, 0]}}),
     ["experiments.retention.fixed.query_turns[1]: expected a positive integer, got 0"]),
    ("a RULER setting misspelt", smoke(accuracy={"fixed": {"ruler": {"max_seq_length": [256]}}}),
     ["experiments.accuracy.fixed.ruler: max_seq_length: unknown key"]),
    ("an exploratory limit of 0", smoke(accuracy={"exploratory": {"policies": ["kivi"], "fixed": {"limit": 0}}}),
     ["experiments.accuracy.exploratory.fixed.limit: expected a positive integer, got 0"]),
    ("repeats of 0", smoke(ttft={"repeats": 0}), ["experiments.ttft.repeats: expected a positive integer, got 0"]),
    ("a validity gate above 1", {**smoke(), "validity_gate": 2}, ["validity_gate: expected a share in (0, 1], got 2"]),
    ("a capacity below 0", {**smoke(), "device_capacity_gb": -1},
     ["device_capacity_gb: expected a positive number, got -1"]),
    ("weights that do not exist", {**smoke(), "weights": "zeros"}, ["weights: expected one of"]),
    ("an unknown experiment", {**smoke(), "experiments": {"tfft": {}}}, ["experiments.tfft: unknown experiment"]),
    ("an unknown top-level key", {**smoke(), "colour": "red"}, ["colour: unknown key 'colour'"]),
    ("no model", {k: v for k, v in smoke().items() if k != "model"}, ["model: `model` is required"]),
    ("a profile that is a list", [1, 2], ["(profile): expected a mapping"]),
]


@pytest.mark.parametrize("what, raw, expected", BAD, ids=[b[0] for b in BAD])
def test_a_malformed_profile_lists_every_problem_at_its_key_path(root, what, raw, expected):
    problems = check_profile(copy.deepcopy(raw))
    assert len(problems) == len(expected), problems
    for want in expected:
        assert any(p.startswith(want) for p in problems), (want, problems)
    (root / "params" / "bad.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(UserError) as caught:
        study.load_profile("bad")
    assert all(want in str(caught.value) for want in expected)


def test_a_profile_that_fails_creates_nothing_under_results(root, capsys):
    (root / "params" / "bad.yaml").write_text(yaml.safe_dump(smoke(ttft={"grid": {"prompt_tokens": ["abc"]}})))
    assert cli.main(["study", "--profile", "bad", "--experiments", "ttft", "--compute-only"]) != 0
    assert "experiments.ttft.grid.prompt_tokens[0]: expected a positive integer, got 'abc'" in capsys.readouterr().err
    assert not (root / "results").exists() or not any((root / "results").rglob("*"))


@pytest.mark.parametrize("name", ["embedded", "paper", "paper-shapes"])
def test_the_books_profiles_run_rounds_the_by_round_test_can_settle_at(name):
    """Finding 2 is settled by Holm at its share of the findings page (first threshold share / its declared claims),
    a timing chapter's lead at its page's 5 %: the by-round test's smallest p-value at a profile's rounds, 2 / 2^n, must
    reach them, or nothing can be settled (the paper profiles once ran 4 rounds: 2/16 = 0.125). The embedded book
    trims TTFT and decode length to 2 rounds on purpose (params/embedded.yaml: no verdict rests on them)."""
    from kvlib.report.pages import FINDINGS
    from kvlib.report.stats import smallest_p_value
    from kvlib.study.methods_figures import can_settle, threshold

    profile = study.load_profile(name)
    first = FINDINGS.share("finding 2") / dict(FINDINGS.weights)["finding 2"]
    assert threshold("batch_scaling")[0] == pytest.approx(first)
    n = profile.repeats("batch_scaling")
    assert smallest_p_value(n, n, paired=True) <= first, (name, n)
    for experiment in ("ttft", "decode_length") if name != "embedded" else ():
        assert can_settle(profile.repeats(experiment), experiment), (name, experiment)
