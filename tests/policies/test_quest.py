"""Quest: per-block channel min/max of keys, upper-bound scoring, top blocks read; checked against loops."""

import math

import pytest
import torch

from kvlib.engine import Engine
from kvlib.errors import UserError
from kvlib.policies import make_policy


def allowed(n, budget):
    return min(n, max(1, round(budget * n)))


def reference_blocks(keys, q, n, bs, budget, group):
    """keys [Hkv, n, D] of one row, q [Hq, D]: per KV head, the set of blocks Quest reads (loops)."""
    blocks = -(-n // bs)
    kept = allowed(n, budget)  # the kernels' page budget token_budget // page_size; the whole row within it
    pages = blocks if kept >= n else max(1, kept // bs)
    chosen = []
    for h in range(keys.shape[0]):
        bound = []
        for j in range(blocks):
            block = keys[h, j * bs:min((j + 1) * bs, n)]
            low, high = block.min(dim=0).values, block.max(dim=0).values
            per_query = [float(torch.maximum(q[h * group + g] * high, q[h * group + g] * low).sum())
                         for g in range(group)]
            bound.append(max(per_query))
        bound[blocks - 1] = math.inf  # the block being written is always read
        chosen.append(set(sorted(range(blocks), key=lambda j: -bound[j])[:pages]))
    return chosen


def test_block_bounds_and_selection_match_loops_after_prefill_and_decode(tiny, kernel):
    """On both selection paths (C where decode attention runs the C kernel, PyTorch elsewhere)."""
    torch.manual_seed(1)
    lens, bs, budget = (45, 22), 4, 0.3
    prompts = [torch.randint(100, 5000, (n,)).tolist() for n in lens]
    policy = make_policy("quest", budget=budget, block_size=bs, dense_layers=1)
    keys, picks, checks = {}, [], []
    attend, choose, after = policy.attend, policy.choose_blocks, policy.after_pass

    def recording_attend(layer, q, k, v, step):
        for i, row in enumerate(step.rows.tolist()):
            old = keys.get((layer, row), k[i, :, :0])
            keys[(layer, row)] = torch.cat([old, k[i]], dim=1)
        policy.current = (layer, step.rows.tolist(), q.clone(),
                          [keys[(layer, row)].clone() for row in step.rows.tolist()])
        return attend(layer, q, k, v, step)

    def recording_choose(layer, query):
        table, lengths = choose(layer, query)
        picks.append((policy.current, policy.table.clone(), table.clone(), lengths.clone()))
        return table, lengths

    def checking_after(step):  # the metadata: each block's channel-wise min and max, every layer
        after(step)
        for row in step.rows.tolist():
            table = policy.tables[row].blocks
            for layer in range(tiny.spec.num_layers):
                k = keys[(layer, row)]
                for j, block in enumerate(table):
                    part = k[:, j * bs:(j + 1) * bs].transpose(0, 1)  # [tokens, Hkv, D]
                    assert torch.equal(policy.key_min[layer, block], part.min(dim=0).values)
                    assert torch.equal(policy.key_max[layer, block], part.max(dim=0).values)
            checks.append(step.phase)
    policy.attend, policy.choose_blocks, policy.after_pass = recording_attend, recording_choose, checking_after
    result = Engine(tiny, policy).generate(prompts, 6, prefill_mode="chunked", chunk_size=16, stop_at_eos=False)
    assert result.stats["decode_attention"] == kernel
    assert checks.count("prefill") == 3 + 2 and checks.count("decode") == 2 * 5
    assert len(picks) == 5 * (tiny.spec.num_layers - 1)  # the first layer stays dense
    group = tiny.spec.num_attention_heads // tiny.spec.num_kv_heads
    for (layer, rows, q, held), row_tables, table, lengths in picks:
        for i, row in enumerate(rows):
            n = held[i].shape[1]
            want = reference_blocks(held[i], q[i, :, 0], n, bs, budget, group)
            positions = row_tables[i].tolist()
            got = [[positions.index(x) for x in table[i, h, :-(-int(lengths[i, h]) // bs)].tolist()]
                   for h in range(table.shape[1])]
            assert got == [sorted(s) for s in want], (layer, row, n)  # the chosen blocks, in position order
            assert lengths[i].tolist() == [(len(s) - 1) * bs + n - (-(-n // bs) - 1) * bs for s in want]
            assert all(len(s) < -(-n // bs) for s in want)  # fewer blocks read than the row holds


def test_memory_is_not_saved_but_reads_are(tiny):
    torch.manual_seed(2)
    prompts = [torch.randint(100, 5000, (n,)).tolist() for n in (120, 64)]
    policy = make_policy("quest", budget=0.2, block_size=8)
    result = Engine(tiny, policy).generate(prompts, 4, prefill_mode="fused", stop_at_eos=False)
    held_tokens = sum(-(-(n + 3) // 8) * 8 for n in (120, 64))  # every token stays, in whole blocks
    assert result.memory["device"]["kv_bytes"] == tiny.spec.kv_bytes(held_tokens)
    stats = result.stats
    # 2 of 4 layers dense; the others read ~0.2 of the tokens plus every block's min/max (1/8 of a token a block)
    assert 0.55 < stats["kv_bytes_read"] / stats["kv_bytes_read_full"] < 0.7
    assert stats["kv_share_attended_per_layer"][:2] == [1.0, 1.0]
    # 3 decode steps; the page budget is 0.2 x seen // 8 blocks, the last (1-3 tokens) among them: 3 blocks of the
    # 121-123-token row (16 + 1-3 tokens), 1 of the 65-67-token row (its last, 1-3 tokens)
    assert stats["kv_share_attended_per_layer"][3] == pytest.approx((16 * 3 + 2 * (1 + 2 + 3)) / (3 * 122 + 3 * 66))


@pytest.mark.model
def test_budget_one_equals_full_through_the_selection(smollm, mixed_prompts):
    full = Engine(smollm, make_policy("full")).generate(mixed_prompts, 16)
    policy = make_policy("quest", budget=1.0, block_size=4)
    calls = []
    choose = policy.choose_blocks
    policy.choose_blocks = lambda *args: calls.append(1) or choose(*args)
    got = Engine(smollm, policy).generate(mixed_prompts, 16, prefill_mode="chunked", chunk_size=5)
    assert [o["token_ids"] for o in got.outputs] == [o["token_ids"] for o in full.outputs]
    assert len(calls) == 15 * (smollm.spec.num_layers - 2)


@pytest.mark.parametrize("settings, message", [
    ({"block_size": 6}, "block_size must be a power of two"),
    ({"dense_layers": -1}, "dense_layers must be"),
    ({"budget": 0}, "budget must be in"),
])
def test_bad_settings_are_one_clear_error(settings, message):
    with pytest.raises(UserError, match=message):
        make_policy("quest", **settings)
