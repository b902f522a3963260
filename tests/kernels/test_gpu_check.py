"""Issue 52's GPU check: the gpu-check profile is the check the issue asks for, `--toy` and `--device` run it at
another size and place (kvlib.study.overrides) into a results folder of their own, its one command
(benchmarks/gpu_check.sh) runs end to end on a CPU at the toy size with every policy's decode throughput in its rows,
and the parts that need a GPU are skipped without one."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from kvlib import cli, study
from kvlib.errors import UserError
from kvlib.study import results
from kvlib.study.schema import check_profile

REPO = Path(__file__).parents[2]
PROFILE = REPO / "params" / "gpu-check.yaml"
POLICIES = {"full", "paged", "h2o", "infinigen"}


@pytest.fixture
def root(tmp_path, monkeypatch):
    """A checkout of its own (KVLIB_ROOT) holding the shipped gpu-check profile: results go there."""
    monkeypatch.setenv("KVLIB_ROOT", str(tmp_path))
    (tmp_path / "params").mkdir()
    shutil.copy(PROFILE, tmp_path / "params")
    return tmp_path


def test_the_profile_is_the_issue_s_check():
    """Llama-3.1-8B's shape, random weights, on CUDA (bf16 there by default), the four policies at batch 16 with
    4,096-token prompts and 64 new tokens, at most two repeats, and its expected time said to be an estimate."""
    profile = study.load_profile("gpu-check")
    assert (profile.model, profile.weights, profile.device) == ("llama-3.1-8b", "random", "cuda")
    assert list(profile.experiments) == ["batch_scaling"] and profile.repeats("batch_scaling") in (1, 2)
    points = profile.points("batch_scaling")
    assert {p.runner for p in points} == POLICIES and len(points) == len(POLICIES)
    assert all(p.values == {"batch_size": 16, "min_prompt_tokens": 4096, "max_prompt_tokens": 4096,
                            "max_new_tokens": 64} for p in points)
    assert "ESTIMATE" in yaml.safe_load(PROFILE.read_text())["description"]


def test_the_toy_on_a_cpu_runs_the_same_policies_smaller_into_its_own_folder():
    full, toy = study.load_profile("gpu-check"), study.load_profile("gpu-check", device="cpu", toy=True)
    assert toy.name == "gpu-check-toy-cpu" and toy.device == "cpu" and toy.weights == "random"
    assert toy.model == "smollm2-135m" and toy.repeats("batch_scaling") == 1
    assert list(toy.experiments) == list(full.experiments)
    points = {p.runner: p for p in toy.points("batch_scaling")}
    assert set(points) == POLICIES
    assert points["full"].values == {"batch_size": 2, "min_prompt_tokens": 64, "max_prompt_tokens": 64,
                                     "max_new_tokens": 4}
    assert points["h2o"].settings["budget_rule"] == "flexgen"  # the profile's fixed values kept, key by key
    assert points["infinigen"].settings["calibration_tokens"] == 64
    big = {p.runner: p for p in full.points("batch_scaling")}
    assert big["infinigen"].settings["calibration_tokens"] != 64  # the toy's settings stay the toy's
    assert study.load_profile("gpu-check", toy=True).name == "gpu-check-toy"
    assert study.load_profile("gpu-check", device="cpu").name == "gpu-check-cpu"
    assert study.load_profile("gpu-check", device="cuda").name == "gpu-check"  # the profile's own device


@pytest.mark.parametrize("toy, message", [
    ({"experiments": {"ttft": {"repeats": 1}}}, "toy.experiments.ttft: not an experiment of the profile"),
    ({"colour": "red"}, "toy: unknown key 'colour'"),
    ({"experiments": {"batch_scaling": {"policies": ["full"]}}}, "unknown key 'policies'"),
    ({"experiments": {"batch_scaling": {"grid": {"batch_size": [0]}}}},
     r"toy: laid over the profile, experiments.batch_scaling.grid.batch_size\[0\]: expected a positive integer"),
    ({"model": 3}, "toy: laid over the profile, model: expected a name"),
])
def test_a_bad_toy_is_one_clear_error_at_its_key(root, toy, message):
    raw = yaml.safe_load(PROFILE.read_text())
    raw["toy"] = toy
    assert [p for p in check_profile(raw) if re.search(message, p)]
    (root / "params" / "gpu-check.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(UserError, match=message):
        study.load_profile("gpu-check")


def test_overrides_are_refused_where_they_cannot_hold(root):
    raw = yaml.safe_load(PROFILE.read_text())
    del raw["toy"]
    (root / "params" / "plain.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(UserError, match="no toy size"):
        study.load_profile("plain", toy=True)
    with pytest.raises(UserError, match="--device 'gpu' is not a device"):
        study.load_profile("gpu-check", device="gpu")
    with pytest.raises(UserError, match="add --compute-only"):  # the notebooks read a profile by its file's name
        study.run_study("gpu-check", device="cpu", toy=True)
    assert cli.main(["study", "--profile", "gpu-check", "--toy"]) == 2
    assert not (root / "results").exists()


def run_script(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVLIB_ROOT": str(root), "PYTHON": sys.executable,
           "OMP_NUM_THREADS": "1"}  # a toy's few matmuls: a shared 2-core machine's threads only fight over them
    return subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=600, check=False)


@pytest.mark.model
@pytest.mark.slow
def test_the_one_command_runs_the_toy_on_a_cpu_end_to_end(root):
    """benchmarks/gpu_check.sh --toy --device cpu: the machine's measures and the study's rows, every policy with a
    decode throughput, in results/gpu-check-toy-cpu/ and nowhere else."""
    proc = run_script(root, "--toy", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = results.load("gpu-check-toy-cpu", "batch_scaling")
    assert set(rows["runner"]) == POLICIES and len(rows) == len(POLICIES)
    assert (rows["decode_tokens_per_s"] > 0).all() and (rows["decode_tokens"] == 2 * 3).all()
    assert set(rows["device"]) == {"cpu"} and set(rows["weights"]) == {"random"}
    machine = json.loads((root / "results" / "gpu-check-toy-cpu" / "machine.json").read_text())
    assert machine["read_gb_per_s"] > 0 and machine["host_copy_gb_per_s"] > 0
    assert (machine["cuda"] is None) == (not torch.cuda.is_available())  # not measured is null, never 0
    gather = json.loads((root / "results" / "gpu-check-toy-cpu" / "infinigen_gather.json").read_text())
    assert gather["device"] == "cpu" and gather["gather"] and gather["loop"]
    assert sorted(p.name for p in (root / "results").iterdir()) == ["gpu-check-toy-cpu"]


def test_the_one_command_takes_only_its_own_options(root):
    proc = run_script(root, "--profile", "paper")
    assert proc.returncode == 2 and "usage" in proc.stderr
    assert not (root / "results").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.model
def test_the_toy_on_the_gpu(root):
    """The same code paths on the GPU in seconds (bf16, InfiniGen's host tier pinned): every policy's row."""
    assert cli.main(["study", "--profile", "gpu-check", "--toy", "--compute-only"]) == 0
    rows = results.load("gpu-check-toy", "batch_scaling")
    assert set(rows["runner"]) == POLICIES and (rows["decode_tokens_per_s"] > 0).all()
    assert set(rows["device"]) == {"cuda"}


def gather_figures(tmp_path: Path, device: str) -> dict:
    """benchmarks/bench_infinigen_gather.py at its toy size, as the one command runs it."""
    out = tmp_path / "infinigen_gather.json"
    env = {**os.environ, "KVLIB_BENCH_SMOKE": "1", "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_infinigen_gather.py"), "--device", device,
                    "--out", str(out)], env=env, check=True, timeout=300, cwd=REPO)
    return json.loads(out.read_text())


def test_infinigen_s_gather_is_measured_apart(tmp_path):
    """The one command's InfiniGen measure: the three ways to gather, each share, and kvlib's per-layer fetches
    against one fused gather; the copy apart only where there is a device to copy to."""
    assert "bench_infinigen_gather.py" in (REPO / "benchmarks" / "gpu_check.sh").read_text()
    figures = gather_figures(tmp_path, "cpu")
    assert {(g["share"], g["way"]) for g in figures["gather"]} == {
        (share, way) for share in (0.1, 0.2, 0.3)
        for way in ("advanced index (new tensor)", "embedding (new tensor)", "index_select out= (reused buffer)")}
    assert all(g["min"] <= g["median"] <= g["max"] and g["bytes"] > 0 for g in figures["gather"] + figures["loop"])
    assert len(figures["loop"]) == 2 * 4 and figures["copy"] == [] and figures["gpu"] is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_infinigen_s_copy_is_measured_pinned_and_pageable(tmp_path):
    figures = gather_figures(tmp_path, "cuda")
    assert {c["from"] for c in figures["copy"]} == {"pageable", "pinned, side stream"}
    assert figures["shape"]["dtype"] == "float16" and all(c["gb_per_s"] > 0 for c in figures["copy"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_machine_s_gpu_limits_are_measured(tmp_path):
    out = tmp_path / "machine.json"
    env = {**os.environ, "KVLIB_BENCH_SMOKE": "1", "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_machine.py"), "--out", str(out)], env=env,
                   check=True, timeout=600, cwd=REPO / "benchmarks")
    gpu = json.loads(out.read_text())["cuda"]
    assert all(gpu[k] > 0 for k in ("device_read_gb_per_s", "matmul_bf16_tflop_per_s", "host_to_device_pinned_gb_per_s",
                                    "device_to_host_pinned_gb_per_s", "host_to_device_latency_us",
                                    "device_to_host_latency_us"))
