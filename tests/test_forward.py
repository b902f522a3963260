"""The engine's shared kernels: paged attention read in place, and the prepacked linear layers."""

import pytest
import torch
import torch.nn.functional as F

from kvlib.attention import paged_decode_attention
from kvlib.models import PackedLinear, can_prepack, prepack_linears
from kvlib.policies.paged import IN_PLACE_MIN_TOKENS, block_runs, decode_layout


def test_block_runs_split_where_block_ids_jump():
    # blocks 3,4,5 then 9 then 10: runs of consecutive ids; the last block holds 2 of its 4 slots
    assert block_runs([3, 4, 5, 9, 10], 18, 4) == [(12, 12), (36, 6)]
    assert block_runs([7], 1, 4) == [(28, 1)]


@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_decode_attention_equals_dense_attention_over_each_row(block_size):
    """Rows of different lengths, in runs long enough to be read in place and in scattered blocks gathered as the
    tail, equal SDPA over each row's own keys (its blocks in table order)."""
    torch.manual_seed(0)
    hkv, g, d = 3, 3, 16
    blocks = 200
    pool_k, pool_v = torch.randn(blocks * block_size, hkv, d), torch.randn(blocks * block_size, hkv, d)
    free = torch.randperm(blocks).tolist()
    lengths = [1, IN_PLACE_MIN_TOKENS + 5, 3 * IN_PLACE_MIN_TOKENS, 2 * block_size + 1]
    tables = []
    for i, n in enumerate(lengths):
        need = -(-n // block_size)
        if i == 2:  # a long contiguous run then scattered blocks: in place + tail
            start = 100
            table = list(range(start, start + need - 2)) + [free.pop() for _ in range(2)]
        else:
            table = [free.pop() for _ in range(need)]
        tables.append(table)
    layout = decode_layout(tables, lengths, block_size, "cpu")
    assert layout.tail_index is not None and any(layout.runs)  # both paths are exercised
    query = torch.randn(len(lengths), hkv * g, 1, d)
    out = paged_decode_attention(query, pool_k[None], pool_v[None], layout, d ** -0.5)
    for r, (table, n) in enumerate(zip(tables, lengths)):
        slots = torch.tensor([b * block_size + i for b in table for i in range(block_size)][:n])
        k, v = pool_k[slots].transpose(0, 1)[None], pool_v[slots].transpose(0, 1)[None]
        expected = F.scaled_dot_product_attention(query[r:r + 1], k, v, scale=d ** -0.5, enable_gqa=True)
        torch.testing.assert_close(out[r:r + 1], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_packed_linear_matches_linear_within_tolerance():
    torch.manual_seed(1)
    linear = torch.nn.Linear(576, 1536, bias=False)
    packed = PackedLinear(linear)
    for rows in (1, 16, 300):
        x = torch.randn(rows, 1, 576)
        torch.testing.assert_close(packed(x), linear(x), atol=2e-4, rtol=1e-4)
    assert packed.weight.numel() == linear.weight.numel()  # the same bytes booked as weights


@pytest.mark.model
def test_prepacked_model_keeps_greedy_tokens_and_logits_close(smollm, mixed_prompts):
    """Prepacking changes the matmuls' summation order: logits move by ~1e-4, greedy tokens do not."""
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
    # the tied head is packed as a copy, booked; the embedding table stays dense for lookups
    assert isinstance(plain.model.lm_head, PackedLinear)
    assert plain.weights_bytes == dense_bytes + head.weight.numel() * head.weight.element_size()
    assert plain.model.get_input_embeddings().weight.layout == torch.strided
    plain = load_model("smollm2-135m", device="cpu", prepack=False)
    ids = torch.tensor([mixed_prompts[1]])
    with torch.no_grad():
        a, b = plain.model(ids).logits, smollm.model(ids).logits
    assert (a - b).abs().max() < 1e-3
    runs = [Engine(m, make_policy("full")).generate(mixed_prompts, 16).outputs for m in (plain, smollm)]
    assert [o["token_ids"] for o in runs[0]] == [o["token_ids"] for o in runs[1]]
