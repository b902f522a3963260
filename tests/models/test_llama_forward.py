"""kvlib's own forward pass for Llama-family models (kvlib.models.llama_forward) and the C layer ops it runs on a CPU: the same
tokens as transformers' forward over transformers' own modules, logits within the tolerance the fused matmuls' and
ops' summation order leaves (stated per test)."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from greedy import decode

from kvlib.kernels import cpu_kernel
from kvlib.kernels.attention import register_attention
from kvlib.models.llama_forward import (
    FusedAttention,
    GatedMLP,
    LlamaForward,
    QueryProjection,
    fuse_gate_up,
    fuse_qkv,
    rotate,
)
from kvlib.models.loading import LoadedModel, ModelSpec, speed_up_for_cpu

needs_kernels = pytest.mark.skipif(not cpu_kernel.available(), reason="no C compiler: the kernels are not built")


@pytest.fixture(scope="module")
def llamas(smollm):
    """(transformers' model as loaded, the same weights sped up for the CPU): a 3-layer random Llama whose widths the
    C layer ops take (head dim 64, GQA 2:1)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    register_attention()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=smollm.model.config.vocab_size, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    config._attn_implementation = "kvlib"
    model = LlamaForCausalLM(config).eval()
    spec = ModelSpec.from_config("llama-test", config, torch.float32)
    plain = LoadedModel("llama-test", model, smollm.tokenizer, spec, torch.device("cpu"))
    fast = LoadedModel("llama-test", copy.deepcopy(model), smollm.tokenizer, spec, torch.device("cpu"))
    speed_up_for_cpu(fast)
    return plain, fast


@pytest.fixture(scope="module")
def prompts():
    torch.manual_seed(5)
    return [torch.randint(100, 40000, (n,)).tolist() for n in (37, 5, 130)]


def test_the_sped_up_model_is_llama_forward_over_fused_modules(llamas):
    plain, fast = llamas
    assert plain.kvlib_forward is None and LlamaForward.of(plain.model) is None  # transformers' modules: its forward runs
    assert isinstance(fast.kvlib_forward, LlamaForward)
    layers = fast.model.model.layers
    assert all(isinstance(layer.self_attn, FusedAttention) and type(layer.mlp) is GatedMLP for layer in layers)
    assert fast.weights_bytes == plain.weights_bytes  # the same weights; the tied head's packed copy booked apart
    assert fast.packed_copy_bytes == plain.model.lm_head.weight.nbytes


@pytest.mark.parametrize("policy", ["full", "paged"])
def test_kvlib_forward_gives_transformers_tokens(llamas, prompts, policy):
    """Prepacked, fused matmuls and the C ops against transformers' modules and forward: logits within 1e-4."""
    plain, fast = llamas
    (tokens, logits), (fast_tokens, fast_logits) = decode(plain, prompts, 10, policy), decode(fast, prompts, 10, policy)
    assert tokens == fast_tokens
    torch.testing.assert_close(fast_logits, logits, atol=1e-4, rtol=1e-4)


def test_kvlib_forward_equals_transformers_forward_over_the_same_modules(llamas, prompts):
    """The fused model run by transformers' forward (its decoder layers calling FusedAttention and GatedMLP) and by
    LlamaForward: only the RMSNorm differs (transformers' ops against one C pass), within 1e-5."""
    _, fast = llamas
    through_transformers = dataclasses.replace(fast, kvlib_forward=None)
    (tokens, logits), (ours, our_logits) = decode(through_transformers, prompts, 6), decode(fast, prompts, 6)
    assert tokens == ours
    torch.testing.assert_close(our_logits, logits, atol=1e-5, rtol=1e-5)


def test_the_fused_model_still_runs_as_a_transformers_model(llamas, prompts):
    """A user's own forward call, outside the engine (attention falls back to SDPA): transformers' own logits."""
    plain, fast = llamas
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        torch.testing.assert_close(fast.model(ids).logits, plain.model(ids).logits, atol=1e-4, rtol=1e-4)


@needs_kernels
def test_pytorch_ops_where_the_kernels_are_off_give_the_same_tokens(llamas, prompts, monkeypatch):
    _, fast = llamas
    tokens, logits = decode(fast, prompts, 6, "paged")
    monkeypatch.setenv(cpu_kernel.KERNEL_ENV, "torch")
    torch_tokens, torch_logits = decode(fast, prompts, 6, "paged")
    assert tokens == torch_tokens
    torch.testing.assert_close(logits, torch_logits, atol=1e-5, rtol=1e-5)


def test_query_projection_is_the_query_attention_gets(llamas):
    """What InfiniGen speculates with: the query alone, from the fused and prepacked module (its own copy of the query's
    rows, recovered exactly from the packed layout) and from transformers' module, RoPE applied, equal to the query
    the attention module itself computes."""
    plain, fast = llamas
    torch.manual_seed(2)
    hidden = torch.randn(2, 3, 128)
    positions = torch.tensor([[4, 5, 6], [10, 11, 12]])
    rope = fast.model.model.rotary_emb(hidden, positions)
    fused = fast.model.model.layers[1].self_attn
    ours, theirs = (QueryProjection(m.model.model.layers[1].self_attn)(hidden, rope) for m in (fast, plain))
    assert ours.shape == (2, 4, 3, 64)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours, fused.project(hidden, rope)[0], atol=1e-5, rtol=1e-5)
    assert type(QueryProjection(fused).linear) is type(fused.qkv_proj)  # the same (packed) layout, 4 / 8 as wide
    assert QueryProjection(fused).copied_bytes == 4 * 64 * 128 * 4 and QueryProjection(
        plain.model.model.layers[1].self_attn).copied_bytes == 0


def test_llama_forward_runs_fused_fp32_llamas_only(llamas):
    plain, _ = llamas
    model = copy.deepcopy(plain.model)
    assert LlamaForward.of(model) is None  # transformers' modules
    assert fuse_gate_up(model) == fuse_qkv(model) == 3
    assert isinstance(LlamaForward.of(model), LlamaForward)  # fused, not prepacked: on any device
    # transformers' RMSNorm rounds to bf16 before its weight, F.rms_norm after
    assert LlamaForward.of(model.to(torch.bfloat16)) is None


# -- the C layer ops against PyTorch's ----------------------------------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("rows", [1, 16, 300])  # 300 rows: past the size where they run on the OpenMP threads
def test_add_rms_norm(rows):
    torch.manual_seed(rows)
    x, delta, weight = torch.randn(rows, 576) * 3, torch.randn(rows, 576), torch.randn(576)
    expected_x = x + delta
    expected = F.rms_norm(expected_x, (576,), weight, 1e-5)
    out = cpu_kernel.add_rms_norm(x, delta, weight, 1e-5)
    torch.testing.assert_close(x, expected_x)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cpu_kernel.add_rms_norm(x, None, weight, 1e-5), expected, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("rows, head_dim", [(1, 64), (9, 128), (400, 64)])
def test_rope_on_the_query_and_key_heads_only(rows, head_dim):
    torch.manual_seed(rows)
    heads, width = 5, 7 * head_dim  # 5 rotated heads (Q and K), then 2 left alone (V)
    x = torch.randn(rows, width)
    angles = torch.rand(rows, head_dim // 2) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    expected = x.clone()
    expected[:, :heads * head_dim] = rotate(x[:, :heads * head_dim].view(rows, heads, head_dim), cos[:, None],
                                            sin[:, None]).flatten(1)
    cpu_kernel.rope_(x, heads, head_dim, cos, sin)
    torch.testing.assert_close(x, expected, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 8, 200])
def test_silu_mul(rows):
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536) * 8
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -1e-30])
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(cpu_kernel.silu_mul(gate_up), F.silu(gate) * up, atol=1e-5, rtol=1e-5)
