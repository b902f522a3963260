"""The engine's shared kernels: paged attention read in place, and the prepacked linear layers."""

import pytest
import torch
import torch.nn.functional as F

from kvlib.kernels.attention import attention_with_lse, merge_segments, paged_decode_attention
from kvlib.models.loading import PackedLinear, can_prepack, prepack_linears
from kvlib.policies.paged import MAX_READERS, SPAN_TOKENS, block_runs, decode_layout


def test_block_runs_split_where_block_ids_jump():
    # blocks 3,4,5 then 9 then 10: runs of consecutive ids; the last block holds 2 of its 4 slots
    assert block_runs([3, 4, 5, 9, 10], 18, 4) == [(12, 12), (36, 6)]
    assert block_runs([7], 1, 4) == [(28, 1)]


def paged_against_each_row(tables, lengths, block_size, group, pool_k, pool_v, scale):
    """paged_decode_attention over token-indexed pools [slots, Hkv, D] (laid out head-major, as the policy's), and SDPA
    over each row's own keys (its blocks in table order): both [B, Hq, 1, D]."""
    layout = decode_layout(tables, lengths, block_size, pool_k.shape[0] // block_size, group, torch.float32, "cpu")
    query = torch.randn(len(lengths), pool_k.shape[1] * group, 1, pool_k.shape[2])
    head_major = [c.transpose(0, 1).contiguous()[None] for c in (pool_k, pool_v)]  # [layers, Hkv, slots, D]
    out = paged_decode_attention(query, *head_major, layout, scale)
    expected = []
    for r, (table, n) in enumerate(zip(tables, lengths)):
        slots = torch.tensor([b * block_size + i for b in table for i in range(block_size)][:n])
        k, v = pool_k[slots].transpose(0, 1)[None], pool_v[slots].transpose(0, 1)[None]
        expected.append(F.scaled_dot_product_attention(query[r:r + 1], k, v, scale=scale, enable_gqa=True))
    return layout, out, torch.cat(expected)


@pytest.mark.parametrize("block_size", [4, 16, 512])
def test_paged_decode_attention_equals_dense_attention_over_each_row(block_size):
    """Rows of different lengths equal SDPA over each row's own keys (its blocks in table order), wherever their
    blocks lie: a long run, scattered blocks, a span read by 3 rows (its run of spans padded to 3 readers), a span
    read by more than MAX_READERS rows (gathered as the tail), blocks shared by two rows (a common prefix), and a block
    in the pool's last, partial span."""
    torch.manual_seed(0)
    hkv, g, d = 3, 3, 16
    span = max(SPAN_TOKENS, block_size) // block_size  # blocks per span
    blocks = 8 * span + 8  # the last block in a partial span
    pool_k, pool_v = torch.randn(blocks * block_size, hkv, d), torch.randn(blocks * block_size, hkv, d)
    lengths = [1, 70, 3 * SPAN_TOKENS // 2, 2 * block_size + 1, 2 * block_size + 3, block_size // 2, 1, 1, 1]
    needs = [-(-n // block_size) for n in lengths]
    run = list(range(3 * span, 3 * span + needs[2] - 2))  # row 2: a long run, then two blocks of span 6
    placed = set(run) | {0, 1, 2, 3, 4, 6 * span, 6 * span + 1, 6 * span + 2, 6 * span + 3}
    free = [b for b in torch.randperm(blocks - 1).tolist() if b not in placed]
    tables = [[0], [1] + [free.pop() for _ in range(needs[1] - 1)],  # blocks 0-4: five rows' first blocks
              run + [6 * span, 6 * span + 1], [2] + [free.pop() for _ in range(needs[3] - 1)]]
    tables += [tables[3][:needs[4] - 1] + [6 * span + 2],  # row 4 shares row 3's prefix
               [blocks - 1], [3], [6 * span + 3], [4]]  # span 6: rows 2, 4 and 7 (where a span is several blocks)
    layout, out, expected = paged_against_each_row(tables, lengths, block_size, g, pool_k, pool_v, d ** -0.5)
    if span >= 5:  # every path is exercised: the tail, and a span of 3 readers among spans of fewer (padded slots)
        readers = [int((span_readers < len(lengths)).sum()) for group in layout.groups for span_readers in group.readers]
        assert layout.tail_index is not None and 3 in readers and 1 in readers
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_a_row_holding_much_of_a_crowded_span_reads_it_in_place():
    """A span read by more than MAX_READERS rows: where a long row's prompt ends and the batch's decode blocks begin.
    The long row reads it in place; only the short rows' tokens are gathered, so the tail is as wide as they are."""
    torch.manual_seed(4)
    bs, hkv, g, d = 16, 3, 3, 16
    pool_k, pool_v = torch.randn(64 * bs, hkv, d), torch.randn(64 * bs, hkv, d)
    tables = [list(range(12))] + [[12 + r, 16 + r] for r in range(4)]  # row 0: 12 blocks of span 0; rows 1-4: 1 each
    lengths = [190, 20, 17, 31, 25]
    layout, out, expected = paged_against_each_row(tables, lengths, bs, g, pool_k, pool_v, 0.25)
    assert MAX_READERS < 5 and layout.tail_index.shape == (5, 16)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_a_lone_row_in_one_run_is_one_call_over_the_run():
    torch.manual_seed(3)
    pool_k, pool_v = torch.randn(64 * 4, 3, 16), torch.randn(64 * 4, 3, 16)
    layout, out, expected = paged_against_each_row([[5, 6, 7, 8]], [14], 4, 3, pool_k, pool_v, 0.25)
    assert layout.lone_run and [(g.first_slot, g.span) for g in layout.groups] == [(20, 14)]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_merge_segments_equals_attention_over_the_union():
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 30, 8), torch.randn(1, 2, 30, 8)
    parts = [attention_with_lse(q, k[:, :, a:b], v[:, :, a:b], 0.3) for a, b in ((0, 7), (7, 8), (8, 30))]
    # keys 0-4 again, for no row (segment 1 = rows): dropped; a part with lse -inf (no keys) weighs nothing
    parts.append(attention_with_lse(q, k[:, :, :5], v[:, :, :5], 0.3))
    parts.append((torch.zeros_like(q), torch.full(q.shape[:3], float("-inf"))))
    outs, lses = torch.cat([o for o, _ in parts]), torch.cat([s for _, s in parts])
    merged = merge_segments(outs, lses, torch.tensor([0, 0, 0, 1, 0]), 1)
    torch.testing.assert_close(merged, F.scaled_dot_product_attention(q, k, v, scale=0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_packed_linear_matches_linear_within_tolerance():
    torch.manual_seed(1)
    linear = torch.nn.Linear(576, 1536, bias=False)
    packed = PackedLinear(linear)
    for rows in (1, 16, 300):
        x = torch.randn(rows, 1, 576)
        torch.testing.assert_close(packed(x), linear(x), atol=2e-4, rtol=1e-4)
    assert packed.weight.numel() == linear.weight.numel()  # the same bytes booked as weights


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
