"""An experiment is one file: its `run_point` and its declaration (kvlib.study.experiment). Written as a file of its
own, a toy one registers an experiment that a profile names, that the profile's schema checks by its declaration,
that the study computes and stores, and that the profile guide and its registry-wide tests read."""

import pytest
import test_profile_guide
import yaml
from user_module import user_module

from kvlib.errors import UserError
from kvlib.study import load_profile, profile_guide, results
from kvlib.study.executor import run_experiment
from kvlib.study.experiments import REGISTRY, names

TOY = '''
from kvlib.study.checks import positive_int
from kvlib.study.experiment import Experiment, register


def run_point(point, kept):
    return [{"doubled": 2 * point.values["n"], "runner_seen": point.runner}]


EXPERIMENT = register(Experiment("toy_double", "Doubling", run_point, timed=False,
                                 workload={"n": positive_int}, required=("n",),
                                 meanings={"n": "the number doubled"}))
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy experiment, imported from a file as a user's module would be; unregistered afterwards."""
    monkeypatch.setenv("KVLIB_ROOT", str(tmp_path))  # its results stay out of the checkout
    with user_module(tmp_path / "toy_double.py", TOY, REGISTRY) as added:
        assert added == {"toy_double"}
        yield "toy_double"


def profile_file(tmp_path, spec: dict):
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump({"model": "smollm2-135m", "experiments": {"toy_double": spec}}))
    return str(path)


def test_the_registry_lists_it_after_the_books_own(toy):
    assert names()[-1] == toy and names(timed=False)[-1] == toy


def test_its_declaration_checks_a_profile(toy, tmp_path):
    with pytest.raises(UserError, match=r"toy_double.*\bn\b"):  # required, and missing
        load_profile(profile_file(tmp_path, {"policies": ["full"], "grid": {}}))
    with pytest.raises(UserError, match="expected a positive integer"):
        load_profile(profile_file(tmp_path, {"policies": ["full"], "grid": {"n": ["two"]}}))


def test_the_study_computes_and_stores_it(toy, tmp_path):
    profile = load_profile(profile_file(tmp_path, {"policies": ["full", "h2o"], "grid": {"n": [1, 2]}}))
    run_experiment(profile, toy, progress=False)
    rows = results.load(profile.name, toy)
    assert sorted(zip(rows["runner_seen"], rows["doubled"])) == [("full", 2), ("full", 4), ("h2o", 2), ("h2o", 4)]


def test_the_guide_and_its_registry_wide_tests_read_it(toy):
    assert "| `n` | a positive integer | required | the number doubled |" in profile_guide.workload_table(toy)
    test_profile_guide.test_every_key_the_schema_checks_has_a_meaning_and_a_type()
