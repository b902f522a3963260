"""The `python -m kvlib run` interface that users and outside checks rely on."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.model


def kvlib(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "kvlib", *args], capture_output=True, text=True, env=env, check=False,
                          timeout=300)


@pytest.fixture
def prompt_files(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("The capital of France is")
    b.write_text("Once upon a time, in a land far away, there lived")
    return str(a), str(b)


def test_run_prints_one_json_object(prompt_files, smollm):
    proc = kvlib("run", "--model", "smollm2-135m", "--policy", "full", "--prefill", "fused", "--max-new-tokens", "5",
                 "--prompt-file", prompt_files[0], "--prompt-file", prompt_files[1], "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert len(result["outputs"]) == 2
    first = result["outputs"][0]
    assert first["token_ids"][:2] == [7042, 30] and first["text"].startswith(" Paris")
    assert result["metrics"]["ttft_s"] > 0 and result["metrics"]["decode_tokens_per_s"] > 0
    assert result["memory"]["device"]["kv_bytes"] > 0 and result["memory"]["host"]["kv_bytes"] == 0


@pytest.mark.parametrize("args, message", [
    (["--policy", "nope"], "unknown policy 'nope'"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "cannot read prompt file"),
    (["--set", "budget=0.5"], "has no setting 'budget'"),
    (["--prompt-file", "LONG"], "exceeds the model's context"),
])
def test_bad_input_exits_nonzero_without_traceback(prompt_files, args, message, tmp_path):
    long = tmp_path / "long.txt"
    long.write_text("word " * 9000)  # more tokens than SmolLM2's 8K context
    args = [str(long) if a == "LONG" else a for a in args]
    if "--prompt-file" not in args:
        args = [*args, "--prompt-file", prompt_files[0]]
    proc = kvlib("run", *args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_eval_scores_offline_tasks_under_a_budget(smollm):
    proc = kvlib("eval", "--policy", "h2o", "--budget", "0.1", "--tasks", "kvlib_recall", "--limit", "2")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["policy"]["budget"] == 0.1 and len(out["items"]) == 2
    assert out["scores"][0]["task"] == "kvlib_recall" and 0 <= out["scores"][0]["score"] <= 1


def test_eval_of_an_unknown_task_is_one_clear_error(smollm):
    proc = kvlib("eval", "--tasks", "kvlib_recal")
    assert proc.returncode == 2 and "unknown lm-eval task 'kvlib_recal'" in proc.stderr


@pytest.mark.parametrize("capacity", ["0", "-1"])
def test_a_capacity_that_is_not_positive_is_one_clear_error(capacity, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("Hello")
    proc = kvlib("run", "--prompt-file", str(prompt), "--device-capacity-gb", capacity, "--json")
    assert proc.returncode == 2 and "--device-capacity-gb must be positive" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_capacity_below_the_weights_is_a_recorded_oom_point(smollm, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("Hello there")
    proc = kvlib("run", "--prompt-file", str(prompt), "--device-capacity-gb", "0.1", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["oom"]["where"] == "model weights" and out["metrics"]["completed"] is False


def policies_output(capsys, *args) -> list[str]:
    from kvlib.cli import main

    assert main(["policies", *args]) == 0
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("args", [[], ["--fidelity"]])
def test_policies_fit_a_terminal(capsys, args):
    lines = policies_output(capsys, *args)
    assert lines and max(map(len, lines)) <= 100, max(lines, key=len)


def test_policies_show_each_setting_default_and_meaning(capsys):
    from dataclasses import fields

    from kvlib.study.runners import runner_class, runners

    sections, name = {}, None
    for line in policies_output(capsys):
        if not line.startswith(" "):  # a runner's heading; its settings indented below it
            name = line.split(" ")[0].rstrip(":")
        sections[name] = sections.get(name, "") + line + "\n"
    for name in runners():
        for f in fields(runner_class(name)):
            # `name = default`, then its meaning indented below it
            assert f"\n  {f.name} = " in sections[name], (name, f.name)
            assert sections[name].split(f"\n  {f.name} = ")[1].split("\n")[1].startswith("      "), (name, f.name)
    assert "\n  budget = 0.3\n      the share of the tokens kept" in sections["h2o"]
    assert "full: no settings" in sections["full"]


def test_policies_fidelity_names_each_official_repository_and_commit(capsys):
    from kvlib.policies import REGISTRY

    text = "\n".join(policies_output(capsys, "--fidelity"))
    for cls in REGISTRY.values():
        source = cls.__dict__["fidelity"].source
        assert f"https://github.com/{source.repo} at commit {source.commit}" in text.replace("\n  ", " ")
