"""The Ray executor on a local 2-CPU Ray cluster: the smoke grid gives the serial executor's rows, a worker killed
mid-grid is retried with every unit stored once, an exception in a point is reported with its message, and a rerun
submits nothing. The workers' run_point is faked by tests/study/ray_fakes.py (installed in each worker process)."""

import dataclasses
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest

from kvlib import cli, study
from kvlib.errors import UserError
from kvlib.study import executor, results
from kvlib.study.executor import UnitsFailed
from kvlib.study.experiments import REGISTRY

REPO = Path(__file__).resolve().parents[2]
# columns that measure (time, the machine's load) or describe the process that computed the unit (a Ray worker
# holds cpus_per_point threads): everything else must be the same, whichever executor computed it
MEASURED = {"load_avg_1m", "others_cpu_s", "others_cpu_share", "steal_s", "steal_share", "disturbed", "attempts",
            "finished_at", "cpu_threads", "machine_ray_node"}


def measured(column: str) -> bool:
    return column in MEASURED or column.endswith("_s") or "_per_s" in column or "_s_" in column


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLIB_ROOT", str(tmp_path / "root"))
    (tmp_path / "root" / "params").mkdir(parents=True)
    shutil.copy(REPO / "params" / "smoke.yaml", tmp_path / "root" / "params")
    return tmp_path / "root"


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    # the workers import this checkout's kvlib and the fakes; a loaded machine starts Ray's agents slowly
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'tests' / 'study'}", "RAY_agent_register_timeout_ms": "120000"}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env,
                                                                "worker_process_setup_hook": "ray_fakes.install"})
    yield ray
    ray.shutdown()


def ray_executor(**fake):
    from kvlib.study.ray_executor import RayExecutor

    return RayExecutor(runtime_env={"env_vars": {"KVLIB_FAKE": "1", **fake}})


def fake_serially(monkeypatch):
    import ray_fakes

    for name, experiment in REGISTRY.items():
        monkeypatch.setitem(REGISTRY, name, dataclasses.replace(experiment, run_point=ray_fakes.fake_run_point))


def run(experiment, ex, profile="smoke") -> pd.DataFrame:
    executor.run_experiment(study.load_profile(profile), experiment, progress=False, executor=ex)
    return results.load(profile, experiment)


def comparable(frame: pd.DataFrame) -> pd.DataFrame:
    keep = [c for c in frame.columns if not measured(c)]
    return frame[keep].sort_values(["point_hash", "repeat"]).reset_index(drop=True)


def test_without_ray_the_error_names_the_extra(root, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if it were not installed
    assert cli.main(["study", "--profile", "smoke", "--experiments", "retention", "--compute-only",
                     "--executor", "ray"]) == 2
    assert "pip install -e '.[distributed]'" in capsys.readouterr().err
    assert not list((root / "results").rglob("*.parquet"))


def test_ray_flags_need_the_ray_executor(root, capsys):
    assert cli.main(["study", "--profile", "smoke", "--compute-only", "--address", "10.0.0.1:6379"]) == 2
    assert "need --executor ray" in capsys.readouterr().err


def test_the_smoke_grid_on_ray_gives_the_serial_rows(root, tmp_path, monkeypatch, ray_cluster):
    monkeypatch.setenv("KVLIB_FAKE", "1")
    fake_serially(monkeypatch)
    experiments = study.load_profile("smoke").experiments
    serial = {e: run(e, executor.Serial()) for e in experiments}
    monkeypatch.setenv("KVLIB_ROOT", str(tmp_path / "ray"))
    shutil.copytree(root / "params", tmp_path / "ray" / "params")
    ex = ray_executor()
    on_ray = {e: run(e, ex) for e in experiments}
    assert ex.submitted == sum(len(f) for f in serial.values()) > 0  # every unit of the grid, once
    for e in experiments:
        assert comparable(on_ray[e]).equals(comparable(serial[e])), e
        assert (on_ray[e]["cpu_threads"] == 1).all()  # the worker's own column: Ray gives it one CPU's threads


def test_a_worker_killed_mid_grid_is_retried_and_every_unit_is_stored_once(root, tmp_path, ray_cluster):
    points = study.load_profile("smoke").points("ttft")
    marker = tmp_path / "died"
    ex = ray_executor(KVLIB_FAKE_DIE_ON=points[len(points) // 2].key, KVLIB_FAKE_MARKER=str(marker))
    frame = run("ttft", ex)
    assert marker.exists()  # a worker did die
    assert ex.submitted == len(frame) == 2 * len(points)
    assert not frame.duplicated(["point_hash", "repeat"]).any() and set(frame["point_hash"]) == {
        p.key for p in points}
    out = root / "results" / "smoke" / "ttft"
    assert results.missing_units("smoke", "ttft") == [] and not list(out.glob(".*tmp"))
    assert len(list(out.glob("*.parquet"))) == 2 * len(points)
    run("ttft", ex)  # a rerun: everything is stored
    assert ex.submitted == 2 * len(points)


def test_an_exception_in_a_point_is_reported_with_its_message_and_the_rest_stored(root, ray_cluster, capsys):
    points = study.load_profile("smoke").points("batch_scaling")
    bad = points[3].key
    ex = ray_executor(KVLIB_FAKE_RAISE_ON=bad)
    with pytest.raises(UnitsFailed, match=f"{bad} r0: ValueError: out of memory at {bad}") as failed:
        run("batch_scaling", ex)
    assert isinstance(failed.value, UserError) and len(failed.value.failures) == 1
    assert "Traceback" in failed.value.failures[0][2]  # the worker's traceback comes back with it
    assert f"out of memory at {bad}" in capsys.readouterr().err  # reported as it happened, too
    assert results.missing_units("smoke", "batch_scaling") == [f"{bad}-r0.parquet"]
    assert not list((root / "results" / "smoke" / "batch_scaling").glob(".*tmp"))
    fixed = ray_executor()
    frame = run("batch_scaling", fixed)
    assert fixed.submitted == 1 and len(frame) == len(points)


@pytest.mark.model
@pytest.mark.slow
def test_a_real_point_on_a_ray_worker_is_the_serial_row(root, tmp_path, monkeypatch, ray_cluster):
    import yaml

    from kvlib.study.ray_executor import RayExecutor

    profile = {"model": "smollm2-135m", "device_capacity_gb": None, "policy_settings": {},
               "experiments": {"ttft": {"policies": ["full"], "grid": {"prompt_tokens": [16], "prefill": ["full"]},
                                        "fixed": {"max_new_tokens": 1}}}}
    (root / "params" / "tiny.yaml").write_text(yaml.safe_dump(profile))
    serial = run("ttft", executor.Serial(), "tiny")
    monkeypatch.setenv("KVLIB_ROOT", str(tmp_path / "ray"))
    shutil.copytree(root / "params", tmp_path / "ray" / "params")
    on_ray = run("ttft", RayExecutor(), "tiny")  # no KVLIB_FAKE: the workers run the real run_point
    assert len(serial) == len(on_ray) == 1 and (on_ray["device_kv_bytes"] > 0).all()
    pd.testing.assert_frame_equal(comparable(on_ray), comparable(serial))
