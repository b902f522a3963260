"""The paper's architectures with random weights: published shapes, every policy on their first two layers, KV bytes
by the formula, the ledger's OOM prediction, and the refusals."""

import gc
import json
import re
from pathlib import Path

import pytest
import torch

from kvlib.engine import Engine
from kvlib.engine.capacity import full_matrix_oom_boundary, full_matrix_prefill_bytes, parameter_count
from kvlib.errors import UserError
from kvlib.models import ModelSpec, architectures, load_model
from kvlib.models.random_tokens import NoTextTokenizer, random_token_ids
from kvlib.models.random_weights import build_random_model
from kvlib.models.workloads import mixed_length_prompts, prompt_of_length
from kvlib.policies import available, make_policy
from kvlib.study.kept import Kept
from kvlib.study.point import Point

# D x H_kv x d_h x sizeof(bf16) x 2 for the whole model: 128 KiB and 320 KiB a token
FULL_MODEL_KV_BYTES_PER_TOKEN = {"llama-3.1-8b": 32 * 8 * 128 * 2 * 2, "llama-3.1-70b": 80 * 8 * 128 * 2 * 2}
PUBLISHED = {  # layers, hidden, heads, KV heads, head dim, intermediate
    "llama-3.1-8b": (32, 4096, 32, 8, 128, 14336),
    "llama-3.1-70b": (80, 8192, 64, 8, 128, 28672),
}
LAYERS = 2
# InfiniGen keeps its first dense_layers dense: with one, layer 1 of two is speculated and fetched
POLICY_SETTINGS = {"infinigen": {"dense_layers": 1, "calibration_tokens": 32},
                   "duo": {"sink": 2, "window": 4, "calibration_tokens": 32}}


@pytest.fixture(scope="class", params=["llama-3.1-8b", pytest.param("llama-3.1-70b", marks=pytest.mark.slow)])
def two_layers(request):
    """One architecture at a time, freed when TestTwoLayers ends (the 70B's two layers, embedding and head are 7.6 GB
    in bf16)."""
    model = load_model(request.param, device="cpu", dtype=torch.bfloat16, weights="random", num_layers=LAYERS)
    yield request.param, model
    del model
    gc.collect()


def prompts(tokenizer) -> list[list[int]]:
    return [prompt_of_length(tokenizer, 12), prompt_of_length(tokenizer, 7, offset=100)]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_configs_hold_the_published_shapes(name):
    config = architectures.architecture_config(name)
    shape = (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
             config.head_dim, config.intermediate_size)
    assert shape == PUBLISHED[name]
    assert config.vocab_size == 128256 and config.max_position_embeddings == 131072
    assert config.rope_parameters == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                                      "rope_theta": 500000.0}
    assert ModelSpec.from_config(name, config, torch.bfloat16).kv_bytes_per_token == FULL_MODEL_KV_BYTES_PER_TOKEN[name]
    billions = {"llama-3.1-8b": 8.03, "llama-3.1-70b": 70.55}[name]
    assert parameter_count(config) / 1e9 == pytest.approx(billions, abs=0.01)


class TestTwoLayers:
    """Each configuration cut to its first two layers, every other dimension as published."""

    @pytest.mark.parametrize("policy", available())
    def test_every_policy_runs_on_the_first_two_layers(self, two_layers, policy):
        name, model = two_layers
        assert model.spec.num_layers == LAYERS and model.spec.hidden_size == PUBLISHED[name][1]
        chosen = make_policy(policy, **POLICY_SETTINGS.get(policy, {}))
        # stop_at_eos left on: random weights have no end of sequence, so every request still decodes its full length
        result = Engine(model, chosen).generate(prompts(model.tokenizer), 3, prefill_mode=chosen.preferred_prefill)
        assert result.oom is None
        assert [len(o["token_ids"]) for o in result.outputs] == [3, 3]
        assert all(0 <= t < 128256 for o in result.outputs for t in o["token_ids"])
        assert "random weights: no text" in result.outputs[0]["text"]

    def test_ledger_kv_bytes_per_token_are_the_full_models_formula(self, two_layers):
        name, model = two_layers
        batch = prompts(model.tokenizer)
        result = Engine(model, make_policy("full")).generate(batch, 3)
        cached = sum(len(p) + len(o["token_ids"]) - 1 for p, o in zip(batch, result.outputs))
        per_token = result.memory["device"]["kv_bytes"] / cached
        assert per_token == LAYERS * 8 * 128 * 2 * 2  # what two bf16 layers hold
        full_layers = PUBLISHED[name][0]
        assert per_token * full_layers / LAYERS == FULL_MODEL_KV_BYTES_PER_TOKEN[name]

    def test_predicted_full_matrix_prefill_peak_is_what_the_engine_books(self, two_layers):
        _, model = two_layers
        prompt = prompt_of_length(model.tokenizer, 40)
        predicted = full_matrix_prefill_bytes(model.model.config, torch.bfloat16, len(prompt))
        assert predicted["weights"] == model.weights_bytes
        peak = sum(predicted.values())
        fits = Engine(model, make_policy("full"), device_capacity_bytes=peak).generate([prompt], 1, prefill_mode="full")
        assert fits.oom is None and fits.memory["device"]["peak_bytes"] == peak
        short = Engine(model, make_policy("full"), device_capacity_bytes=peak - 1).generate([prompt], 1,
                                                                                          prefill_mode="full")
        assert short.oom is not None and "attention matrix" in short.oom["where"]


def test_the_book_states_the_computed_oom_boundary():
    boundary = full_matrix_oom_boundary("llama-3.1-8b", 80 * 2**30)
    text = (Path(__file__).parents[2] / "book" / "methods.md").read_text()
    assert f"{boundary:,} tokens" in text
    config = architectures.architecture_config("llama-3.1-8b")
    over = sum(full_matrix_prefill_bytes(config, torch.bfloat16, boundary + 1).values())
    assert sum(full_matrix_prefill_bytes(config, torch.bfloat16, boundary).values()) <= 80 * 2**30 < over
    at_10k = full_matrix_prefill_bytes(config, torch.bfloat16, 10240)
    at_boundary = full_matrix_prefill_bytes(config, torch.bfloat16, boundary)
    assert f"the ledger books {sum(at_10k.values()) / 2**30:.2f} GiB" in text
    for component in ("kv_reserved", "activations", "attention_matrix"):  # the table's two columns
        assert f"| {at_10k[component] / 2**30:.2f} GiB | {at_boundary[component] / 2**30:.2f} GiB |" in text


def test_random_weights_are_seeded():
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    weights = [build_random_model(config, torch.float32, torch.device("cpu"), seed).model.layers[1].mlp.up_proj.weight
               for seed in (0, 0, 1)]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])
    assert weights[0].std().item() == pytest.approx(0.02, rel=0.1)
    assert len({tuple(row.tolist()) for row in weights[0]}) == weights[0].shape[0]  # no two rows alike


def test_prompts_without_a_tokenizer_are_seeded_random_ids():
    tokenizer = NoTextTokenizer("llama-3.1-8b", 128256)
    assert prompt_of_length(tokenizer, 50, offset=7) == random_token_ids(128256, 50, offset=7)
    assert prompt_of_length(tokenizer, 50, offset=7)[:20] == prompt_of_length(tokenizer, 20, offset=7)
    assert prompt_of_length(tokenizer, 20, offset=8) != prompt_of_length(tokenizer, 20, offset=7)
    batch = mixed_length_prompts(tokenizer, 4, 16, 64)
    assert min(map(len, batch)) == 16 and max(map(len, batch)) == 64
    with pytest.raises(UserError, match="random weights and no tokenizer"):
        prompt_of_length(tokenizer, 20, source={"kind": "pydoc"})


def test_a_batch_of_mixed_lengths_tokenizes_the_docs_once():
    """The CPython docs' token ids do not depend on the length asked: tokenized once a tokenizer, not once a prompt."""
    from kvlib.models import workloads

    calls = []

    class Counting:
        def __call__(self, text, add_special_tokens=False):
            calls.append(len(text))
            return {"input_ids": [ord(c) for c in text[:5000]]}

    tokenizer = Counting()
    batch = mixed_length_prompts(tokenizer, 8, 16, 256)
    assert len(calls) == 1 and [len(p) for p in batch] == [len(p) for p in mixed_length_prompts(tokenizer, 8, 16, 256)]
    assert prompt_of_length(tokenizer, 40, offset=3) == [ord(c) for c in workloads._pydoc_text()[3:43]]


def test_gpt_oss_is_refused_naming_what_the_policies_lack():
    with pytest.raises(UserError, match=r"sliding-window attention \(128 tokens\).*attention sinks"):
        load_model("gpt-oss-20b", device="cpu", weights="random", num_layers=2)


def test_named_architectures_have_no_trained_weights_here():
    with pytest.raises(UserError, match="meta-llama/Llama-3.1-8B-Instruct"):
        load_model("llama-3.1-8b", device="cpu")
    with pytest.raises(UserError, match="unknown weights"):
        load_model("llama-3.1-8b", device="cpu", weights="zeros")


@pytest.mark.parametrize("experiment", ["accuracy", "retention"])
def test_accuracy_and_retention_refuse_random_weights(experiment):
    import importlib

    from kvlib.study.profile import validate_profile

    point = Point(experiment, "full", {}, {"task": "kvlib_recall", "query_turns": [2], "buckets": [[8, 16]],
                                           "per_bucket": 1}, "llama-3.1-8b", weights="random")
    with pytest.raises(UserError, match=f"experiment '{experiment}' .* random weights"):
        importlib.import_module(f"kvlib.study.experiments.{experiment}").run_point(point, Kept())
    raw = {"model": "llama-3.1-8b", "weights": "random", "experiments": {experiment: {"policies": ["full"]}}}
    with pytest.raises(UserError, match=re.escape("params/x.yaml: experiment")):
        validate_profile("x", raw)


def test_paper_shapes_profile_runs_the_systems_grids_with_random_weights():
    from kvlib.study import load_profile

    profile = load_profile("paper-shapes")
    paper = load_profile("paper")
    assert profile.model == "llama-3.1-8b" and profile.weights == "random" and profile.device == "cuda"
    assert sorted(profile.experiments) == ["batch_scaling", "decode_length", "ttft"]
    for experiment in profile.experiments:
        points = profile.points(experiment)
        assert all(p.weights == "random" and "text_source" not in p.values for p in points)
        assert {p.runner for p in points} == set(available()) | {"vllm"}
        assert profile.experiments[experiment]["grid"] == paper.experiments[experiment]["grid"]
    assert paper.points("ttft")[0].weights == "pretrained"


def test_result_rows_say_what_random_weights_are_for():
    from kvlib.engine.run_result import RunResult
    from kvlib.study.experiments.common import result_row

    run = RunResult(outputs=[], metrics={}, memory={}, policy={"name": "full"})
    point = Point("ttft", "full", {}, {}, "llama-3.1-8b", weights="random")
    assert result_row(run, point)["caveat"] == "random weights: systems figures only"
    assert "caveat" not in result_row(run, Point("ttft", "full", {}, {}, "smollm2-135m"))


def test_cli_runs_a_named_architecture_with_random_weights(capsys, monkeypatch):
    from kvlib.cli import main
    from kvlib.models import loading

    monkeypatch.setattr(loading, "default_dtype", lambda device: torch.bfloat16)  # 2.6 GB for one layer, not 5

    assert main(["run", "--model", "llama-3.1-8b", "--weights", "random", "--num-layers", "1", "--device", "cpu",
                 "--prompt-tokens", "9", "--prompt-tokens", "5", "--max-new-tokens", "2", "--policy", "paged",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [o["prompt_tokens"] for o in out["outputs"]] == [9, 5]
    assert [len(o["token_ids"]) for o in out["outputs"]] == [2, 2]
    assert main(["run", "--model", "llama-3.1-8b", "--weights", "random", "--num-layers", "1", "--device", "cpu",
                 "--prompt-file", __file__]) == 2
    assert "no tokenizer" in capsys.readouterr().err


def test_a_systems_point_runs_end_to_end_with_random_weights(monkeypatch):
    from kvlib.study import kept
    from kvlib.study.experiments import decode_length, ttft

    def one_layer(name, device=None, weights="pretrained"):
        return load_model(name, device="cpu", dtype=torch.bfloat16, weights=weights, num_layers=1)

    monkeypatch.setattr(kept, "load_model", one_layer)
    process = kept.Kept()  # the model loaded once for both points

    def point(experiment, **values):
        return Point(experiment, "full", {}, values, "llama-3.1-8b", weights="random", device="cpu")

    [row] = ttft.run_point(point("ttft", prompt_tokens=24, prefill="full"), process)
    assert row["completed"] and row["caveat"] == "random weights: systems figures only"
    assert row["device_kv_bytes"] == 24 * 1 * 8 * 128 * 2 * 2
    [row] = decode_length.run_point(point("decode_length", prompt_tokens=16, output_tokens=5), process)
    assert row["decode_tokens"] == 4  # no end of sequence: the asked length


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_whole_8b_model_on_a_gpu():
    """Not yet run: no GPU in the session that wrote it."""
    model = load_model("llama-3.1-8b", device="cuda", weights="random")
    assert model.spec.dtype == torch.bfloat16 and model.spec.kv_bytes_per_token == 128 * 2**10
    assert model.weights_bytes == parameter_count(model.model.config) * 2
    batch = [prompt_of_length(model.tokenizer, 1024), prompt_of_length(model.tokenizer, 300, offset=5000)]
    for policy in available():
        chosen = make_policy(policy)
        result = Engine(model, chosen).generate(batch, 4, prefill_mode=chosen.preferred_prefill)
        assert result.oom is None and [len(o["token_ids"]) for o in result.outputs] == [4, 4]
    assert torch.cuda.max_memory_allocated() >= model.weights_bytes
