"""The study runner: profile validation, grid expansion, stable point hashes, resuming an interrupted run."""

import pandas as pd
import pytest
import yaml

from kvlib import study
from kvlib.errors import UserError
from kvlib.experiments import ttft


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLIB_ROOT", str(tmp_path))
    (tmp_path / "params").mkdir()
    return tmp_path


def write_profile(root, name, body):
    (root / "params" / f"{name}.yaml").write_text(yaml.safe_dump(body))


PROFILE = {"model": "smollm2-135m", "device_capacity_gb": None, "policy_settings": {"h2o": {"budget": 0.3}},
           "experiments": {"ttft": {"policies": ["full", "h2o"],
                                    "grid": {"prompt_tokens": [32, 64], "prefill": ["full", "fused"]},
                                    "fixed": {"max_new_tokens": 1}}}}


def test_the_shipped_profiles_are_valid():
    for name in ("smoke", "embedded", "paper"):
        profile = study.load_profile(name)
        assert profile.points("ttft")


@pytest.mark.parametrize("change, message", [
    ({"colour": "red"}, "unknown key 'colour'"),
    ({"experiments": {"ttfx": {}}}, "unknown experiment 'ttfx'"),
    ({"experiments": {"ttft": {"policies": ["nope"]}}}, "unknown policy 'nope'"),
    ({"policy_settings": {"h2o": {"budjet": 0.3}}}, "unknown key 'budjet'"),
    ({"experiments": {"ttft": {"grid": {"prompt_tokens": []}}}}, "non-empty list"),
    ({"device_capacity_gb": -1}, "device_capacity_gb"),
])
def test_invalid_profiles_get_one_clear_error(root, change, message):
    write_profile(root, "bad", {**PROFILE, **change})
    with pytest.raises(UserError, match=message):
        study.load_profile("bad")


def test_unknown_profile(root):
    with pytest.raises(UserError, match="unknown profile 'nope'"):
        study.load_profile("nope")


def test_grid_expansion_skips_what_a_policy_cannot_run_and_hashes_are_stable(root):
    write_profile(root, "p", PROFILE)
    points = study.load_profile("p").points("ttft")
    assert len(points) == 2 * 2 + 2  # full: 2 lengths x 2 modes; h2o: no fused prefill
    assert {p["policy"] for p in points if p["prefill"] == "fused"} == {"full"}
    assert all(p["policy_settings"] == {"budget": 0.3} for p in points if p["policy"] == "h2o")
    again = study.load_profile("p").points("ttft")
    assert [study.point_hash(p) for p in points] == [study.point_hash(p) for p in again]
    assert len({study.point_hash(p) for p in points}) == len(points)


def test_an_interrupted_run_resumes_without_recomputing(root, monkeypatch):
    write_profile(root, "p", PROFILE)
    calls = []

    def run_point(point):
        if len(calls) == 3:
            raise KeyboardInterrupt  # as if `make book` were killed here
        calls.append(point)
        return [{"ttft_s": 0.1, "oom": False}]

    monkeypatch.setattr(ttft, "run_point", run_point)
    with pytest.raises(KeyboardInterrupt):
        study.run_experiment("p", "ttft", progress=False)
    out = root / "results" / "p" / "ttft"
    assert len(list(out.glob("*.parquet"))) == 3 and not list(out.glob(".*tmp"))
    done = [study.point_hash(p) for p in calls]
    calls.clear()
    monkeypatch.setattr(ttft, "run_point", lambda point: calls.append(point) or [{"ttft_s": 0.2, "oom": False}])
    frame = study.run_experiment("p", "ttft", progress=False)
    assert len(calls) == 3 and not {study.point_hash(p) for p in calls} & set(done)
    assert len(frame) == 6 and set(frame["point_hash"]) >= set(done)
    assert frame.loc[frame["point_hash"].isin(done), "ttft_s"].eq(0.1).all()  # earlier rows kept, not redone
    assert {"git_sha", "torch_version", "profile", "device_name"} <= set(frame.columns)
    calls.clear()
    study.run_experiment("p", "ttft", force=True, progress=False)
    assert len(calls) == 6


@pytest.mark.model
def test_a_real_smoke_point_is_a_tidy_row(root):
    write_profile(root, "p", {**PROFILE, "experiments": {"ttft": {**PROFILE["experiments"]["ttft"],
                                                                   "grid": {"prompt_tokens": [16],
                                                                            "prefill": ["full"]}}}})
    frame = study.run_experiment("p", "ttft", progress=False)
    assert isinstance(frame, pd.DataFrame) and len(frame) == 2
    assert (frame["device_kv_bytes"] > 0).all() and (~frame["oom"]).all()


def test_an_axis_named_after_a_policy_setting_varies_only_policies_that_have_it(root):
    write_profile(root, "p", {**PROFILE, "experiments": {"accuracy": {
        "policies": ["full", "h2o"], "grid": {"task": ["a", "b"], "budget": [0.1, 0.5]}}}})
    points = study.load_profile("p").points("accuracy")
    assert sorted((p["policy"], p.get("budget"), p["task"]) for p in points) == [
        ("full", None, "a"), ("full", None, "b"),
        ("h2o", 0.1, "a"), ("h2o", 0.1, "b"), ("h2o", 0.5, "a"), ("h2o", 0.5, "b")]
    from kvlib.experiments.common import settings_of
    assert settings_of(next(p for p in points if p.get("budget") == 0.5)) == {"budget": 0.5}  # the axis wins


def test_compute_only_runs_the_named_policies_and_no_notebook(root, monkeypatch):
    """What a GPU machine without vLLM or the book's packages runs: `kvlib study --compute-only --policies ...`."""
    from kvlib import cli

    write_profile(root, "p", {**PROFILE, "experiments": {"ttft": {**PROFILE["experiments"]["ttft"],
                                                                   "policies": ["all", "vllm"]}}})
    calls = []
    monkeypatch.setattr(ttft, "run_point", lambda point: calls.append(point["policy"]) or [{"ttft_s": 0.1}])
    monkeypatch.setattr(study, "_execute", lambda *args: pytest.fail("no notebook runs with --compute-only"))
    assert cli.main(["study", "--profile", "p", "--compute-only", "--policies", "full", "h2o"]) == 0
    assert sorted(set(calls)) == ["full", "h2o"] and len(calls) == 6  # 2 lengths x (full: full, fused; h2o: full)
    assert len(list((root / "results" / "p" / "ttft").glob("*.parquet"))) == 6
    assert cli.main(["study", "--profile", "p", "--compute-only", "--policies", "vlm"]) == 2  # one clear error


def test_repeats_run_interleaved_and_every_repeat_is_stored(root, monkeypatch):
    write_profile(root, "p", {**PROFILE, "experiments": {"ttft": {**PROFILE["experiments"]["ttft"], "repeats": 3}}})
    calls = []
    monkeypatch.setattr(ttft, "run_point", lambda point: calls.append(study.point_hash(point)) or [{"ttft_s": 0.1}])
    frame = study.run_experiment("p", "ttft", progress=False)
    points = len(set(calls))
    assert len(calls) == 3 * points and calls[:points] == calls[points:2 * points]  # every point once, then again
    assert sorted(frame["repeat"].unique()) == [0, 1, 2] and len(frame) == 3 * points
    assert {"load_avg_1m", "others_cpu_share", "disturbed", "attempts"} <= set(frame.columns)


def test_a_unit_measured_under_load_is_measured_again_then_flagged(root, monkeypatch):
    from kvlib.machine_load import Load

    write_profile(root, "p", {**PROFILE, "experiments": {"ttft": {**PROFILE["experiments"]["ttft"],
                                                                   "policies": ["full"], "grid": {
                                                                       "prompt_tokens": [32], "prefill": ["fused"]}}}})
    busy = iter([True, False])  # the first attempt ran while another process took the CPU; the second did not

    class Probe:
        def __enter__(self):
            self.load = Load(wall_s=1.0, others_cpu_s=1.0 if next(busy) else 0.0, load_avg_1m=0.0)
            self.load.others_cpu_share = self.load.others_cpu_s / 2
            return self.load

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(study, "measured_load", Probe)
    calls = []
    monkeypatch.setattr(ttft, "run_point", lambda point: calls.append(1) or [{"ttft_s": 0.1}])
    frame = study.run_experiment("p", "ttft", progress=False)
    assert len(calls) == 2 and frame["attempts"].tolist() == [2] and not frame["disturbed"].any()
    busy = iter([True, True])
    frame = study.run_experiment("p", "ttft", progress=False, force=True)
    assert frame["attempts"].tolist() == [2] and frame["disturbed"].all()


def test_the_load_probe_sees_another_process_take_the_cpu():
    import subprocess
    import sys

    from kvlib.machine_load import measured_load

    with measured_load() as quiet:
        sum(range(10**6))
    burn = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"
    with measured_load() as loaded:
        subprocess.run([sys.executable, "-c", burn], check=True)
    if loaded.others_cpu_s is None:
        pytest.skip("no /proc/stat here")
    assert loaded.others_cpu_s > 1.0 and loaded.disturbed
    assert quiet.others_cpu_s < loaded.others_cpu_s
