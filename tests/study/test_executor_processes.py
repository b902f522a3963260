"""An untimed experiment's units shared among one-thread worker processes (kvlib.study.executor.Processes): the same
rows, bit for bit, as one process computes; a timed experiment never shares its cores."""

import pandas as pd
import pytest
import yaml

from kvlib import study
from kvlib.study import executor, results

# what depends on where and when a unit ran, not on what it computed
RUN_COLUMNS = {"unit_compute_s", "load_avg_1m", "others_cpu_s", "others_cpu_share", "steal_s", "steal_share",
               "disturbed", "finished_at", "cpu_threads", "unit_workers", "attempts", "machine_host", "machine_ray_node"}


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLIB_ROOT", str(tmp_path))
    (tmp_path / "params").mkdir()
    profile = {"model": "smollm2-135m", "device_capacity_gb": None, "experiments": {
        "accuracy": {"policies": ["full", "h2o", "streaming"],
                     "grid": {"task": ["kvlib_recall"], "budget": [0.3]},
                     "fixed": {"offline_tasks": {"recall_lengths": [48], "recall_items": 2, "recall_choices": 3,
                                                 "perplexity_docs_n": 2, "perplexity_tokens": 24, "seed": 0}},
                     "arms": [{"policies": ["full", "h2o"], "grid": {"task": ["copa"], "budget": [0.5]},
                               "fixed": {"protocol": "one_pass", "budget_rule": "flexgen", "limit": 2}}]},
        "retention": {"policies": ["full", "h2o"], "grid": {"budget": [0.3]},
                      "fixed": {"buckets": [[200, 400]], "per_bucket": 1, "query_turns": [2, 4], "seed": 0}},
        "ttft": {"policies": ["full"], "grid": {"prompt_tokens": [64]}, "fixed": {"max_new_tokens": 1},
                 "repeats": 1}}}
    (tmp_path / "params" / "p.yaml").write_text(yaml.safe_dump(profile))
    return tmp_path


def rows(experiment: str, **kwargs) -> pd.DataFrame:
    executor.run_experiment(study.load_profile("p"), experiment, progress=False, **kwargs)
    frame = results.load("p", experiment)
    keep = [c for c in frame.columns if c not in RUN_COLUMNS]
    return frame[keep].sort_values([c for c in ("point_hash", "doc_id") if c in keep]).reset_index(drop=True)


@pytest.mark.parametrize("experiment", ["accuracy", "retention"])
def test_workers_compute_the_rows_one_process_computes(root, experiment):
    alone = rows(experiment)
    for unit in (root / "results").glob(f"p/{experiment}/*.parquet"):
        unit.unlink()
    shared = rows(experiment, workers=2)
    assert len(alone) == len(shared) > 0
    pd.testing.assert_frame_equal(alone, shared)
    assert set(results.load("p", experiment)["unit_workers"]) == {2}  # each unit says it shared the machine


def test_a_timed_experiment_runs_alone_whatever_workers_says(root, monkeypatch):
    monkeypatch.setattr(executor, "Processes", lambda *a, **k: pytest.fail("a timed experiment shared its cores"))
    assert len(rows("ttft", workers=2)) == 1


def test_units_that_share_a_key_share_a_worker_and_the_workers_are_balanced():
    points = [study.point.Point("accuracy", "full", {}, {"task": t, "i": i}, "m")
              for t, n in (("a", 3), ("b", 2), ("c", 2), ("d", 1)) for i in range(n)]
    lanes = executor.Processes(2, affinity=lambda p: p.values["task"]).lanes([(p, 0) for p in points])
    tasks = [{p.values["task"] for p, _ in lane} for lane in lanes]
    assert sorted(map(sorted, tasks)) == [["a", "d"], ["b", "c"]]  # 3 + 1 and 2 + 2 units
    assert [len(lane) for lane in executor.Processes(3).lanes([(p, 0) for p in points])] == [3, 3, 2]


def test_workers_are_balanced_by_the_units_expected_time_where_it_is_known():
    points = [study.point.Point("accuracy", "full", {}, {"task": t, "i": i}, "m")
              for t, n in (("recall", 2), ("a", 3), ("b", 3)) for i in range(n)]
    seconds = {"recall": 10.0, "a": 1.0, "b": 1.0}
    lanes = executor.Processes(2, affinity=lambda p: p.values["task"],
                               weight=lambda p, r: seconds[p.values["task"]]).lanes([(p, 0) for p in points])
    assert sorted(sorted({p.values["task"] for p, _ in lane}) for lane in lanes) == [["a", "b"], ["recall"]]


def test_the_units_a_dead_worker_lost_run_again_in_this_process():
    from worker_units import dies_on_task_b  # tests/helpers

    points = [study.point.Point("accuracy", "full", {}, {"task": t, "i": i}, "m") for t in "ab" for i in range(2)]
    processes = executor.Processes(2, affinity=lambda p: p.values["task"])
    processes.in_worker = dies_on_task_b
    processes.here = lambda p, r, meta: pd.DataFrame({"task": [p.values["task"]], "where": ["here"]})
    stored = []
    processes.run([(p, 0) for p in points], {}, lambda p, r, rows: stored.append(rows))
    done = pd.concat(stored).sort_values("task")
    assert list(done["where"]) == ["worker", "worker", "here", "here"]  # task b's two units, both run again here


def test_a_worker_holds_its_largest_model_so_fewer_fit_where_a_model_is_large():
    def at(model):
        return study.point.Point("accuracy", "full", {}, {"task": "piqa"}, model)

    assert executor.worker_gib([at("smollm2-135m"), at("qwen2.5-coder-0.5b")]) == executor.WORKER_GIB
    large = executor.worker_gib([at("smollm2-135m"), at("qwen2.5-coder-1.5b")])
    assert large == pytest.approx(1_543_714_304 * 4 * executor.WEIGHT_COPIES / 2**30)  # ~12.6 GiB
    assert executor.untimed_workers(large) <= executor.untimed_workers(executor.WORKER_GIB)


def test_a_worker_holds_what_its_experiment_says_it_holds_beside_the_model():
    from kvlib.study.experiments import accuracy

    def at(**values):
        return study.point.Point("accuracy", "full", {}, {"task": "kvlib_recall", **values}, "smollm2-135m")

    held = accuracy.EXPERIMENT.held_gib
    weights = 134_515_008 * 4 * executor.WEIGHT_COPIES / 2**30
    assert executor.worker_gib([at(prefill_store_gb=16)], held) == pytest.approx(weights + 16)  # the store it fills
    assert executor.worker_gib([at(prefill_store_gb=16, protocol="one_pass")], held) == executor.WORKER_GIB  # none
    assert executor.worker_gib([at(prefill_store_gb=16)]) == executor.WORKER_GIB  # an experiment that holds nothing


def test_a_large_model_runs_alone_while_the_small_models_units_still_share_the_cores(monkeypatch):
    monkeypatch.setattr(executor, "untimed_workers", lambda gib: 2 if gib <= executor.WORKER_GIB else 1)
    units = [(study.point.Point("accuracy", "full", {}, {"task": "piqa", "i": i}, model), 0)
             for i, model in enumerate(["smollm2-135m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"])]
    parts = executor.memory_parts(units, workers=2)
    assert [(n, [p.values["i"] for p, _ in part]) for n, part in parts] == [(2, [0, 2, 3]), (1, [1])]
    assert [n for n, _ in executor.memory_parts(units, workers=1)] == [1]  # never more than asked
    assert [n for n, _ in executor.memory_parts(units[:1], workers=2)] == [1]  # never more than a unit each


def test_the_workers_and_the_outside_engines_process_end_when_their_study_is_killed_alone(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    helpers = Path(__file__).parents[1] / "helpers"
    script = (f"import sys; sys.path.insert(0, {str(helpers)!r}); from worker_units import study_with_a_sleeping_worker;"
              f" study_with_a_sleeping_worker({str(tmp_path / 'pid')!r})")
    study_process = subprocess.Popen([sys.executable, "-c", script])
    names = ("a", "b", "outside")
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"pid.{t}").exists() for t in names) and time.monotonic() < deadline:
            time.sleep(0.5)
        workers = [int((tmp_path / f"pid.{t}").read_text()) for t in names]
    finally:
        study_process.send_signal(signal.SIGKILL)  # the study alone, not its process group
        study_process.wait()

    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(alive(pid) for pid in workers)
