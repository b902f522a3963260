"""An experiment's arms (kvlib.study.profile): other policies over another grid, on the experiment's fixed values."""

import pytest
import yaml

from kvlib.errors import UserError
from kvlib.study.profile import load_profile

PROFILE = {
    "model": "smollm2-135m",
    "experiments": {"accuracy": {
        "policies": ["full", "h2o"],
        "grid": {"task": ["kvlib_recall"], "budget": [0.5]},
        "fixed": {"limit": 4, "budget_rule": "seen"},
        "arms": [{"policies": ["h2o", "infinigen"], "grid": {"task": ["piqa"], "budget": [0.1, 0.3]},
                  "fixed": {"protocol": "one_pass", "budget_rule": "flexgen"}, "role": "exploratory",
                  "model": "qwen2.5-coder-0.5b"}]}}}


def points(tmp_path, profile=PROFILE):
    path = tmp_path / "arms.yaml"
    path.write_text(yaml.safe_dump(profile))
    return load_profile(str(path), tmp_path).points("accuracy")


def test_an_arm_adds_its_policies_over_its_own_grid_on_the_experiments_fixed_values(tmp_path):
    main, arm = [], []
    for p in points(tmp_path):
        (arm if p.values.get("protocol") == "one_pass" else main).append(p)
    assert sorted((p.runner, p.values["task"]) for p in main) == [("full", "kvlib_recall"), ("h2o", "kvlib_recall")]
    assert sorted((p.runner, p.settings["budget"]) for p in arm) == [("h2o", 0.1), ("h2o", 0.3), ("infinigen", 0.1),
                                                                     ("infinigen", 0.3)]
    assert {p.values["limit"] for p in arm} == {4}  # the experiment's fixed value
    assert {p.settings["budget_rule"] for p in arm if p.runner == "h2o"} == {"flexgen"}  # the arm's, laid over
    assert {p.values["role"] for p in arm} == {"exploratory"} and all("role" not in p.values for p in main)  # (no exploratory part)
    assert {p.model for p in arm} == {"qwen2.5-coder-0.5b"} and {p.model for p in main} == {"smollm2-135m"}
    assert len({p.key for p in points(tmp_path)}) == 6


def test_an_arms_values_are_checked_as_the_grids_are(tmp_path):
    bad = {**PROFILE, "experiments": {"accuracy": {**PROFILE["experiments"]["accuracy"], "arms": [
        {"policies": ["h2o"], "grid": {"budget": ["half"]}, "colour": 1, "role": "decisive"}]}}}
    with pytest.raises(UserError) as err:
        points(tmp_path, bad)
    assert "experiments.accuracy.arms[0].grid.budget[0]: expected float" in str(err.value)
    assert "unknown key 'colour'" in str(err.value)
    assert "arms[0].role: expected confirmatory or exploratory, got 'decisive'" in str(err.value)
