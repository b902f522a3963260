"""The engine's prepacked linear layers."""

import pytest
import torch

from kvlib.models.loading import PackedLinear, can_prepack, prepack_linears


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_packed_linear_matches_linear_within_tolerance():
    torch.manual_seed(1)
    linear = torch.nn.Linear(576, 1536, bias=False)
    packed = PackedLinear(linear)
    for rows in (1, 16, 300):
        x = torch.randn(rows, 1, 576)
        torch.testing.assert_close(packed(x), linear(x), atol=2e-4, rtol=1e-4)
    assert packed.weight.numel() == linear.weight.numel()  # the same bytes booked as weights
    assert torch.equal(packed.dense_weight(), linear.weight)  # recovered exactly from the packed layout


def test_gated_mlp_computes_the_mlp_it_replaces():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from kvlib.models.llama_forward import GatedMLP, fuse_gate_up

    torch.manual_seed(5)
    mlp = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=160, hidden_act="silu"))
    x = torch.randn(3, 2, 64)
    holder = torch.nn.Sequential(mlp)
    assert fuse_gate_up(holder) == 1 and isinstance(holder[0], GatedMLP)
    assert sum(p.numel() for p in holder.parameters()) == sum(p.numel() for p in mlp.parameters())
    torch.testing.assert_close(holder[0](x), mlp(x), atol=1e-5, rtol=1e-5)


@pytest.mark.model
def test_prepacked_model_keeps_greedy_tokens_and_logits_close(smollm, mixed_prompts):
    """Prepacking and the fused gate/up change the matmuls' summation order: logits move by ~1e-4, greedy tokens do
    not."""
    from kvlib.engine import Engine
    from kvlib.models import load_model
    from kvlib.policies import make_policy

    if not can_prepack(smollm.model):
        pytest.skip("needs a CPU fp32 model and oneDNN")
    plain = load_model("smollm2-135m", device="cpu", prepack=False)
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    assert any(isinstance(m, PackedLinear) for m in smollm.model.modules())
    head = plain.model.get_output_embeddings()
    dense_bytes = plain.weights_bytes
    assert prepack_linears(plain.model) > 0 and plain.weights_bytes == smollm.weights_bytes
    # the tied head is packed as a copy, booked apart; the embedding table stays dense for lookups
    assert isinstance(plain.model.lm_head, PackedLinear) and plain.weights_bytes == dense_bytes
    assert plain.packed_copy_bytes == head.weight.numel() * head.weight.element_size()
    assert plain.model.get_input_embeddings().weight.layout == torch.strided
    plain = load_model("smollm2-135m", device="cpu", prepack=False)
    ids = torch.tensor([mixed_prompts[1]])
    with torch.no_grad():
        a, b = plain.model(ids).logits, smollm.model(ids).logits
    assert (a - b).abs().max() < 1e-3
    runs = [Engine(m, make_policy("full")).generate(mixed_prompts, 16).outputs for m in (plain, smollm)]
    assert [o["token_ids"] for o in runs[0]] == [o["token_ids"] for o in runs[1]]
