"""The study runner: profile validation, grid expansion into typed points, stable keys, resuming an interrupted
run, the manifest readers load, and the notebook's loader."""

import dataclasses
import itertools

import pandas as pd
import pytest
import yaml

from kvlib import study
from kvlib.errors import UserError
from kvlib.study import executor, results
from kvlib.study.experiments import REGISTRY


def fake(monkeypatch, name: str, run_point) -> None:
    """The experiment's run_point replaced for this test: its registered declaration holds it."""
    monkeypatch.setitem(REGISTRY, name, dataclasses.replace(REGISTRY[name], run_point=run_point))


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLIB_ROOT", str(tmp_path))
    (tmp_path / "params").mkdir()
    return tmp_path


def write_profile(root, name, body):
    (root / "params" / f"{name}.yaml").write_text(yaml.safe_dump(body))


def run_experiment(name, experiment="ttft", **kwargs) -> pd.DataFrame:
    executor.run_experiment(study.load_profile(name), experiment, progress=False, **kwargs)
    return results.load(name, experiment)


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
    ({"experiments": {"ttft": {"policies": ["nope"]}}}, "policies: unknown key 'nope'"),
    ({"policy_settings": {"h2o": {"budget": 2}}}, "policy_settings.h2o.budget: budget must be in"),
    ({"experiments": {"accuracy": {"policies": ["h2o"], "grid": {"budget": [0.1, 1.5]}}}},
     r"experiments.accuracy.grid.budget\[1\]: budget must be in"),
    ({"policy_settings": {"h2o": {"budjet": 0.3}}}, "unknown key 'budjet'"),
    ({"experiments": {"ttft": {"grid": {"prompt_tokens": []}}}}, "non-empty list"),
    ({"device_capacity_gb": -1}, "device_capacity_gb"),
    ({"validity_gate": 1.5}, "validity_gate: expected a share"),
    ({"experiments": {"ttft": {"model": ["smollm2-135m"]}}}, "experiments.ttft.model: must be a model name"),
    ({"experiments": {"ttft": {"device_capacity_gb": 0}}}, "experiments.ttft.device_capacity_gb: expected a positive number"),
])
def test_invalid_profiles_get_one_clear_error(root, change, message):
    write_profile(root, "bad", {**PROFILE, **change})
    with pytest.raises(UserError, match=message):
        study.load_profile("bad")


def test_an_experiment_names_its_own_model_and_the_gate_is_a_setting(root):
    """accuracy and retention on the model that passes their tasks, the systems chapters on the profile's model."""
    accuracy = {"policies": ["full"], "grid": {"task": ["kvlib_recall"]}, "model": "qwen2.5-coder-0.5b"}
    write_profile(root, "two", {**PROFILE, "validity_gate": 0.8,
                                "experiments": {**PROFILE["experiments"], "accuracy": accuracy}})
    profile = study.load_profile("two")
    assert {p.model for p in profile.points("accuracy")} == {"qwen2.5-coder-0.5b"}
    assert {p.model for p in profile.points("ttft")} == {"smollm2-135m"}
    assert all(p.columns()["model"] == "qwen2.5-coder-0.5b" for p in profile.points("accuracy"))
    write_profile(root, "one", PROFILE)
    assert profile.validity_gate == 0.8 and study.load_profile("one").validity_gate == 0.7


def test_an_experiment_on_another_model_has_its_own_device_capacity():
    """The embedded profile's 1.25 GB is sized for SmolLM2; retention's Qwen weights alone are 2.4 GB in fp32 (a fresh
    `make book` failed there before experiments could say so)."""
    profile = study.load_profile("embedded")
    assert {p.device_capacity_gb for p in profile.points("ttft")} == {1.25}
    assert {(p.model, p.device_capacity_gb) for p in profile.points("retention")} == {("qwen2.5-coder-0.5b", None)}
    assert all(p.columns()["device_capacity_gb"] is None for p in profile.points("retention"))


def test_exploratory_policies_run_on_their_own_fixed_values_and_say_so(root):
    accuracy = {"policies": ["full", "h2o", "streaming"], "grid": {"task": ["kvlib_recall"], "budget": [0.1]},
                "fixed": {"limit": 200}, "exploratory": {"policies": ["streaming"], "fixed": {"limit": 40}}}
    write_profile(root, "explore", {**PROFILE, "experiments": {"accuracy": accuracy}})
    points = {p.runner: p for p in study.load_profile("explore").points("accuracy")}
    assert points["streaming"].values["limit"] == 40 and points["streaming"].values["role"] == "exploratory"
    assert points["h2o"].values["limit"] == 200 and points["h2o"].values["role"] == "confirmatory"
    assert points["full"].columns()["role"] == "confirmatory"
    write_profile(root, "bad", {**PROFILE, "experiments": {"accuracy": {**accuracy, "exploratory": {"policy": []}}}})
    with pytest.raises(UserError, match="exploratory: unknown key 'policy'"):
        study.load_profile("bad")


def test_unknown_profile(root):
    with pytest.raises(UserError, match="unknown profile 'nope'"):
        study.load_profile("nope")
    with pytest.raises(UserError, match="profile file 'elsewhere/mine.yaml' does not exist"):
        study.load_profile("elsewhere/mine.yaml")


def test_a_profile_given_as_a_path_to_a_users_own_file(root, tmp_path, monkeypatch):
    from kvlib import cli

    mine = tmp_path / "elsewhere" / "mine.yaml"
    mine.parent.mkdir()
    mine.write_text(yaml.safe_dump({**PROFILE, "experiments": {"ttft": {**PROFILE["experiments"]["ttft"],
                                                                          "policies": ["full"]}}}))
    profile = study.load_profile(str(mine))
    assert profile.name == "mine" and len(profile.points("ttft")) == 4
    fake(monkeypatch, "ttft", lambda point, kept: [{"ttft_s": 0.1, "oom": False}])
    assert cli.main(["study", "--profile", str(mine), "--compute-only"]) == 0
    assert len(results.load("mine", "ttft")) == 4


def test_grid_expansion_skips_what_a_policy_cannot_run_and_hashes_are_stable(root):
    write_profile(root, "p", PROFILE)
    points = study.load_profile("p").points("ttft")
    assert len(points) == 2 * 2 + 2  # full: 2 lengths x 2 modes; h2o: no fused prefill
    assert {p.runner for p in points if p.values["prefill"] == "fused"} == {"full"}
    h2o = [p for p in points if p.runner == "h2o"]
    assert all(p.settings["budget"] == 0.3 and p.settings["budget_rule"] == "seen" for p in h2o)  # all resolved
    assert all(p.settings == {} for p in points if p.runner == "full")
    again = study.load_profile("p").points("ttft")
    assert [p.key for p in points] == [p.key for p in again]
    assert len({p.key for p in points}) == len(points)


def test_an_exception_in_a_unit_is_recorded_and_the_others_stored(root, monkeypatch, capsys):
    """The serial executor treats a failing unit as the Ray executor does: reported with its message as it happens,
    nothing written for it, every other unit stored, and the run fails naming it; a rerun computes only it."""
    write_profile(root, "p", {**PROFILE, "experiments": {"ttft": {**PROFILE["experiments"]["ttft"], "repeats": 2}}})
    points = study.load_profile("p").points("ttft")
    bad = points[1].key

    def run_point(point, kept):
        if point.key == bad:
            raise ValueError(f"broken at {point.key}")
        return [{"ttft_s": 0.1, "oom": False}]

    fake(monkeypatch, "ttft", run_point)
    with pytest.raises(executor.UnitsFailed, match=f"{bad} r0: ValueError: broken at {bad}") as failed:
        run_experiment("p")
    assert len(failed.value.failures) == 2 and "Traceback" in failed.value.failures[0][2]  # both repeats
    assert f"broken at {bad}" in capsys.readouterr().err
    assert results.missing_units("p", "ttft") == [f"{bad}-r0.parquet", f"{bad}-r1.parquet"]
    assert not list((root / "results" / "p" / "ttft").glob(".*tmp"))
    calls = []
    fake(monkeypatch, "ttft", lambda point, kept: calls.append(point) or [{"ttft_s": 0.2, "oom": False}])
    assert len(run_experiment("p")) == 2 * len(points) and {p.key for p in calls} == {bad} and len(calls) == 2


def test_an_outside_engine_point_is_computed_in_a_process_of_its_own(root, monkeypatch):
    """vLLM's start changes the process it runs in (book/methods.md): its points never share one with kvlib's; they
    share one among themselves, so that vLLM starts once."""
    import os

    outside = executor.in_outside_process(os.getpid)
    assert outside != os.getpid() and executor.in_outside_process(os.getpid) == outside
    with pytest.raises(ValueError, match="invalid literal"):  # an exception comes back as itself
        executor.in_outside_process(int, "not a number")
    assert executor.in_outside_process(os.getpid) == outside
    with pytest.raises(executor.BrokenProcessPool):
        executor.in_outside_process(os._exit, 1)
    assert executor.in_outside_process(os.getpid) not in (outside, os.getpid())  # a dead one replaced
    write_profile(root, "p", {**PROFILE, "experiments": {"ttft": {
        "policies": ["full", "vllm"], "grid": {"prompt_tokens": [32]}, "fixed": {"max_new_tokens": 1,
                                                                                   "prefill": "chunked"}}}})
    isolated = []
    monkeypatch.setattr(executor, "in_outside_process", lambda fn, point, *rest: isolated.append(point.runner)
                        or fn(point, *rest))
    fake(monkeypatch, "ttft", lambda point, kept: [{"ttft_s": 0.1, "oom": False}])
    frame = run_experiment("p")
    assert sorted(frame["runner"]) == ["full", "vllm"] and isolated == ["vllm"]


def test_an_interrupted_run_resumes_without_recomputing(root, monkeypatch):
    write_profile(root, "p", PROFILE)
    calls = []

    def run_point(point, kept):
        if len(calls) == 3:
            raise KeyboardInterrupt  # as if `make book` were killed here
        calls.append(point)
        return [{"ttft_s": 0.1, "oom": False}]

    fake(monkeypatch, "ttft", run_point)
    with pytest.raises(KeyboardInterrupt):
        run_experiment("p")
    out = root / "results" / "p" / "ttft"
    assert len(list(out.glob("*.parquet"))) == 3 and not list(out.glob(".*tmp"))
    assert len(results.missing_units("p", "ttft")) == 3
    done = [p.key for p in calls]
    calls.clear()
    fake(monkeypatch, "ttft", lambda point, kept: calls.append(point) or [{"ttft_s": 0.2, "oom": False}])
    frame = run_experiment("p")
    assert len(calls) == 3 and not {p.key for p in calls} & set(done)
    assert len(frame) == 6 and set(frame["point_hash"]) >= set(done)
    assert frame.loc[frame["point_hash"].isin(done), "ttft_s"].eq(0.1).all()  # earlier rows kept, not redone
    assert {"git_sha", "torch_version", "profile", "device_name"} <= set(frame.columns)
    calls.clear()
    run_experiment("p", force=True)
    assert len(calls) == 6


def test_readers_load_the_grid_of_the_profile_as_it_is_now(root, monkeypatch):
    """A point dropped from the profile stays on disk but leaves the book: the manifest names the current grid."""
    write_profile(root, "p", PROFILE)
    fake(monkeypatch, "ttft", lambda point, kept: [{"ttft_s": 0.1, "oom": False}])
    assert len(run_experiment("p")) == 6
    write_profile(root, "p", {**PROFILE, "experiments": {"ttft": {**PROFILE["experiments"]["ttft"],
                                                                   "policies": ["full"]}}})
    frame = run_experiment("p")
    assert len(frame) == 4 and set(frame["policy"]) == {"full"}
    assert len(list((root / "results" / "p" / "ttft").glob("*.parquet"))) == 6


def test_a_notebook_computes_what_is_missing_or_says_which_command_will(root, monkeypatch, capsys):
    write_profile(root, "p", PROFILE)
    fake(monkeypatch, "ttft", lambda point, kept: [{"ttft_s": 0.1, "oom": False}])
    assert study.load("p", "ttft", compute_missing=False).empty
    assert "kvlib study --profile p --experiments ttft --compute-only" in capsys.readouterr().out
    assert len(study.load("p", "ttft")) == 6  # opened interactively: computed through the same executor
    assert "computing them now" in capsys.readouterr().out
    assert len(study.load("p", "ttft", compute_missing=False)) == 6 and capsys.readouterr().out == ""
    # an experiment the profile has no grid for (the findings page reads every one): nothing to compute, said so
    assert study.load("p", "offload").empty
    assert "the profile has no offload experiment" in capsys.readouterr().out


def test_a_budget_set_in_policy_settings_is_a_column_the_tables_read(root, monkeypatch):
    from kvlib.report.accuracy.tables import accuracy_table

    write_profile(root, "p", {**PROFILE, "experiments": {"accuracy": {"policies": ["full", "h2o"],
                                                                       "grid": {"task": ["a"]}}}})
    fake(monkeypatch, "accuracy", lambda point, kept: [{"task": "a", "correct": 1.0}])
    table = accuracy_table(run_experiment("p", "accuracy"))
    assert dict(zip(table["policy"], table["budget"])) == {"full": 1.0, "h2o": 0.3}


@pytest.mark.model
def test_a_real_smoke_point_is_a_tidy_row(root):
    write_profile(root, "p", {**PROFILE, "experiments": {"ttft": {**PROFILE["experiments"]["ttft"],
                                                                   "grid": {"prompt_tokens": [16],
                                                                            "prefill": ["full"]}}}})
    frame = run_experiment("p")
    assert isinstance(frame, pd.DataFrame) and len(frame) == 2
    assert (frame["device_kv_bytes"] > 0).all() and (~frame["oom"]).all()


def test_an_axis_named_after_a_policy_setting_varies_only_policies_that_have_it(root):
    write_profile(root, "p", {**PROFILE, "experiments": {"accuracy": {
        "policies": ["full", "h2o"], "grid": {"task": ["a", "b"], "budget": [0.1, 0.5]}}}})
    points = study.load_profile("p").points("accuracy")
    assert sorted((p.runner, p.settings.get("budget"), p.values["task"]) for p in points) == [
        ("full", None, "a"), ("full", None, "b"),
        ("h2o", 0.1, "a"), ("h2o", 0.1, "b"), ("h2o", 0.5, "a"), ("h2o", 0.5, "b")]  # the axis wins over 0.3
    assert all("budget" not in p.values for p in points)


def test_compute_only_runs_the_named_policies_and_no_notebook(root, monkeypatch):
    """What a GPU machine without vLLM or the book's packages runs: `kvlib study --compute-only --policies ...`."""
    from kvlib import cli

    write_profile(root, "p", {**PROFILE, "experiments": {"ttft": {**PROFILE["experiments"]["ttft"],
                                                                   "policies": ["all", "vllm"]}}})
    calls = []
    fake(monkeypatch, "ttft", lambda point, kept: calls.append(point.runner) or [{"ttft_s": 0.1}])
    monkeypatch.setattr(study.book, "execute", lambda *args: pytest.fail("no notebook runs with --compute-only"))
    assert cli.main(["study", "--profile", "p", "--compute-only", "--policies", "full", "h2o"]) == 0
    assert sorted(set(calls)) == ["full", "h2o"] and len(calls) == 6  # 2 lengths x (full: full, fused; h2o: full)
    assert len(list((root / "results" / "p" / "ttft").glob("*.parquet"))) == 6
    assert cli.main(["study", "--profile", "p", "--compute-only", "--policies", "vlm"]) == 2  # one clear error


def test_repeats_run_in_rounds_each_in_a_seeded_random_order_recorded_in_the_rows(root, monkeypatch):
    write_profile(root, "p", {**PROFILE, "experiments": {"ttft": {**PROFILE["experiments"]["ttft"], "repeats": 3}}})
    calls = []
    fake(monkeypatch, "ttft", lambda point, kept: calls.append(point.key) or [{"ttft_s": 0.1}])
    frame = run_experiment("p")
    points = len(set(calls))
    rounds = [calls[i * points:(i + 1) * points] for i in range(3)]
    assert all(sorted(r) == sorted(set(calls)) for r in rounds)  # every point once a round, then again
    assert len({tuple(r) for r in rounds}) > 1  # in another order each round (6 points: 1 in 720 alike)
    for r, order in enumerate(rounds):  # the order each unit ran in is in its row
        slots = frame[frame["repeat"] == r].set_index("point_hash")["round_slot"]
        assert [key for key, _ in sorted(slots.items(), key=lambda kv: kv[1])] == order
    assert sorted(frame["repeat"].unique()) == [0, 1, 2] and len(frame) == 3 * points
    assert {"load_avg_1m", "others_cpu_share", "steal_share", "disturbed", "attempts"} <= set(frame.columns)
    assert {"machine_host", "machine_cpu", "machine_cpu_flags", "machine_gpu", "machine_ray_node"} <= set(frame.columns)
    assert frame["machine_cpu"].notna().all() and frame["machine_ray_node"].isna().all()  # no Ray here
    # a rerun draws the same order (a resumed run computes what is missing in the order the first run would have)
    from kvlib.study.executor import rounds as order_of

    again = order_of(list(range(points)), 3, "p/ttft")
    assert again == order_of(list(range(points)), 3, "p/ttft")
    assert [p for p, _, _ in order_of(list(range(points)), 1, "p/ttft", shuffled=False)] == list(range(points))


def test_accuracy_points_run_task_by_task_and_by_prefill_arithmetic(root, monkeypatch):
    """So that the prefill store holds what the next point reads (kvlib.study.experiments.accuracy.order)."""
    spec = {"policies": ["full", "h2o", "snapkv"], "grid": {"task": ["b_task", "a_task"], "budget": [0.1]}}
    write_profile(root, "acc", {**PROFILE, "experiments": {"accuracy": spec}})
    calls = []
    fake(monkeypatch, "accuracy", lambda point, kept: calls.append((point.values["task"], point.runner))
                        or [{"task": point.values["task"], "correct": 1.0}])
    run_experiment("acc", "accuracy")
    assert calls == [("a_task", "h2o"), ("a_task", "full"), ("a_task", "snapkv"),  # h2o: full-matrix prefill
                     ("b_task", "h2o"), ("b_task", "full"), ("b_task", "snapkv")]


def test_a_unit_measured_under_load_is_measured_again_then_flagged(root, monkeypatch):
    from kvlib.study.machine_load import Load

    write_profile(root, "p", {**PROFILE, "experiments": {"ttft": {**PROFILE["experiments"]["ttft"],
                                                                   "policies": ["full"], "grid": {
                                                                       "prompt_tokens": [32], "prefill": ["fused"]}}}})
    busy = iter([True, False])  # the first attempt ran while another process took the CPU; the second did not

    class Probe:
        def __init__(self, family=None):
            pass

        def __enter__(self):
            self.load = Load(wall_s=1.0, others_cpu_s=1.0 if next(busy) else 0.0, load_avg_1m=0.0)
            self.load.others_cpu_share = self.load.others_cpu_s / 2
            return self.load

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(executor, "measured_load", Probe)
    calls = []
    fake(monkeypatch, "ttft", lambda point, kept: calls.append(1) or [{"ttft_s": 0.1}])
    frame = run_experiment("p")
    assert len(calls) == 2 and frame["attempts"].tolist() == [2] and not frame["disturbed"].any()
    assert frame["unit_compute_s"].tolist() == [2.0]  # what the unit cost the build: both attempts
    busy = iter([True, True])
    frame = run_experiment("p", force=True)
    assert frame["attempts"].tolist() == [2] and frame["disturbed"].all()
    # a score is the same under load: an accuracy unit is computed once, and its row still says it was disturbed
    write_profile(root, "acc", {**PROFILE, "experiments": {"accuracy": {"policies": ["full"],
                                                                        "grid": {"task": ["kvlib_recall"]}}}})
    busy, calls = iter([True, True]), []
    fake(monkeypatch, "accuracy", lambda point, kept: calls.append(1) or [{"correct": 1.0}])
    frame = run_experiment("acc", "accuracy")
    assert len(calls) == 1 and frame["attempts"].tolist() == [1] and frame["disturbed"].all()


def test_the_load_probe_sees_another_process_take_the_cpu():
    import subprocess
    import sys

    from kvlib.study.machine_load import measured_load

    with measured_load() as quiet:
        sum(range(10**6))
    burn = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"
    with measured_load() as loaded:
        subprocess.run([sys.executable, "-c", burn], check=True)
    if loaded.others_cpu_s is None:
        pytest.skip("no /proc/stat here")
    assert loaded.others_cpu_s > 1.0 and loaded.disturbed
    assert quiet.others_cpu_s < loaded.others_cpu_s


def test_time_stolen_by_the_hypervisor_counts_as_disturbance():
    """On a VM a noisy neighbour shows as steal, not as other processes' time."""
    from kvlib.study.machine_load import Load

    assert not Load(wall_s=4.0, others_cpu_s=0.1, others_cpu_share=0.0125, steal_s=0.1, steal_share=0.0125).disturbed
    stolen = Load(wall_s=4.0, others_cpu_s=0.1, others_cpu_share=0.0125, steal_s=1.6, steal_share=0.2)
    assert stolen.disturbed and stolen.taken_share == pytest.approx(0.2125)
    both = Load(wall_s=4.0, others_cpu_s=0.48, others_cpu_share=0.06, steal_s=0.48, steal_share=0.06)
    assert both.disturbed  # neither alone is above 10 %, together they are
    assert not Load(wall_s=0.1, others_cpu_s=0.0, others_cpu_share=0.0, steal_s=0.1, steal_share=0.5).disturbed


def test_the_load_probe_reads_steal_from_proc_stat(monkeypatch):
    from kvlib.study import machine_load

    ticks = iter([(1000, 50), (1000, 50 + 2 * machine_load.CLOCK_TICKS)])  # (busy, stolen): 2 s stolen, no one busy
    monkeypatch.setattr(machine_load, "_cpu_ticks", lambda: next(ticks))
    monkeypatch.setattr(machine_load.os, "cpu_count", lambda: 2)
    clock = itertools.count(0.0, 4.0)  # 4 s of wall time between entering and leaving
    monkeypatch.setattr(machine_load.time, "perf_counter", lambda: next(clock))
    with machine_load.measured_load() as load:
        pass
    assert load.steal_s == pytest.approx(2.0) and load.steal_share == pytest.approx(0.25)
    assert load.others_cpu_s == 0.0 and load.disturbed and load.columns()["steal_share"] == pytest.approx(0.25)
