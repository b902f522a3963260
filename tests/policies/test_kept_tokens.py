"""The kept-tokens structure of the scored-eviction policies (kvlib.policies.kept_tokens), on its own: a prompt opened,
stored and compacted; one eviction a decode step; compression to a share; fork; release. Every key is written as its
position (plus 100 x its head), so a test can tell whether keys moved with their positions and scores."""

import torch

from kvlib.models import ModelSpec
from kvlib.policies.allocation import select_heavy_recent, select_per_head
from kvlib.policies.kept_tokens import KeptTokens

SPEC = ModelSpec("kept", num_layers=2, num_attention_heads=2, num_kv_heads=2, head_dim=4, hidden_size=8,
                 max_context=64, dtype=torch.float32)
HEADS = torch.arange(SPEC.num_kv_heads)
SCORES = torch.tensor([[5., 1, 9, 2, 8, 3, 6, 6], [1., 9, 2, 8, 3, 7, 6, 6]])  # [Hkv, 8] a prompt's scores


def make(per_head_counts=False, batch=2) -> KeptTokens:
    return KeptTokens.allocate(SPEC, torch.device("cpu"), num_blocks=12, block_size=4, batch_size=batch,
                               per_head_counts=per_head_counts)


def encoded(positions: torch.Tensor) -> torch.Tensor:
    """[Hkv, n, D] keys that say their position and head."""
    return (positions[None, :, None] + 100 * HEADS[:, None, None]).float().expand(-1, -1, SPEC.head_dim).clone()


def prefill(tokens: KeptTokens, row: int, scores: torch.Tensor) -> None:
    """The row's prompt (scores [Hkv, n], the same in every layer) stored as one pass, not yet compacted."""
    n = scores.shape[1]
    tokens.open_prompt(row, n)
    positions = torch.arange(n)
    slots = tokens.kv.slots(row, 0, n)
    for layer in range(SPEC.num_layers):
        tokens.store_prompt(layer, slots, encoded(positions), -encoded(positions), positions, scores)
    tokens.seen[row] += n
    tokens.filling[row] += n


def compact_uniform(tokens: KeptTokens, row: int, keep: int, recent: int) -> None:
    chosen = select_heavy_recent(tokens.prompt_scores(row), keep - recent, recent)
    tokens.compact(row, chosen, torch.full((SPEC.num_layers, SPEC.num_kv_heads), keep), keep)


def decode_step(tokens: KeptTokens, rows: list[int], scores: torch.Tensor, limits) -> None:
    """One decode step: each row's new token (position seen[row]) with scores [B, Hkv], then evict_one."""
    rows = torch.tensor(rows)
    tokens.prepare_decode(rows)
    positions = tokens.seen[rows][:, None].expand(-1, SPEC.num_kv_heads)
    keys = (positions + 100 * HEADS[None, :]).float()[..., None].expand(-1, -1, SPEC.head_dim)
    for layer in range(SPEC.num_layers):
        tokens.append(layer, keys, -keys, positions, scores)
    tokens.evict_one(rows, limits)
    tokens.end_decode()


def aligned(tokens: KeptTokens, row: int) -> bool:
    """Every held slot's key and value are those of the position beside them."""
    slots = tokens.kv.slots(row, 0, int(tokens.region[row]))
    pos = tokens.positions[:, :, slots]
    want = (pos + 100 * HEADS[None, :, None]).float()
    held = pos >= 0
    keys, values = tokens.kv.keys[:, :, slots, 0], tokens.kv.values[:, :, slots, 0]
    return bool((keys[held] == want[held]).all() and (values[held] == -want[held]).all())


def test_compaction_keeps_the_chosen_entries_in_position_order_and_frees_the_rest():
    tokens = make()
    scores = torch.tensor([[5., 1, 9, 2, 8, 3, 0, 0, 0, 0], [1., 9, 2, 8, 3, 7, 0, 0, 0, 0]])
    prefill(tokens, 0, scores)
    assert tokens.kv.pool.used == 3
    compact_uniform(tokens, 0, keep=6, recent=4)
    assert tokens.kept_positions(0, 0) == [{2, 4, 6, 7, 8, 9}, {1, 3, 6, 7, 8, 9}]
    order = tokens.positions[0][:, tokens.kv.slots(0, 0, 6)]
    assert (order.diff(dim=-1) > 0).all()  # in position order, in the row's first slots
    assert aligned(tokens, 0) and tokens.kv.pool.used == 2 and int(tokens.kept[0]) == 6
    assert 0 not in tokens.filling and int(tokens.prompt_of[0]) == 10


def test_evict_one_drops_each_heads_lowest_score_outside_the_recent_window():
    tokens = make()
    prefill(tokens, 0, SCORES)
    compact_uniform(tokens, 0, keep=8, recent=2)  # everything kept
    decode_step(tokens, [0], torch.zeros(1, 2), lambda seen, prompt: (8, 2))
    # over budget by one: head 0 drops position 1 (score 1), head 1 position 0 (score 1); the window (7, 8) stays
    assert tokens.kept_positions(0, 0) == [set(range(9)) - {1}, set(range(9)) - {0}]
    assert tokens.kept_positions(1, 0) == tokens.kept_positions(0, 0) and aligned(tokens, 0)
    assert int(tokens.kept[0]) == 8 and int(tokens.seen[0]) == 9
    # the next token takes each head's freed slot, and the head's next-lowest older entry goes
    decode_step(tokens, [0], torch.zeros(1, 2), lambda seen, prompt: (8, 2))
    assert tokens.kept_positions(0, 0) == [set(range(10)) - {1, 3}, set(range(10)) - {0, 2}]
    assert aligned(tokens, 0) and int(tokens.region[0]) == 9  # the holes were reused: no slot past the first nine


def test_a_row_under_its_limits_evicts_nothing():
    tokens = make()
    prefill(tokens, 0, torch.rand(2, 5))
    compact_uniform(tokens, 0, keep=5, recent=1)
    decode_step(tokens, [0], torch.zeros(1, 2), lambda seen, prompt: (seen, 1))
    assert tokens.kept_positions(0, 0) == [set(range(6))] * 2 and int(tokens.kept[0]) == 6


def test_compress_keeps_the_top_scored_and_the_recent_in_position_order():
    tokens = make()
    prefill(tokens, 0, SCORES)
    compact_uniform(tokens, 0, keep=8, recent=2)
    decode_step(tokens, [0], torch.zeros(1, 2), lambda seen, prompt: (8, 2))  # a hole, then out of position order
    used = tokens.kv.pool.used
    tokens.compress(0, 4, lambda scores: select_heavy_recent(scores, 2, 2), restart_limits=False)
    assert tokens.kept_positions(0, 0) == [{2, 4, 7, 8}, {1, 3, 7, 8}]
    order = tokens.positions[0][:, tokens.kv.slots(0, 0, 4)]
    assert (order.diff(dim=-1) > 0).all() and aligned(tokens, 0)
    assert tokens.kv.pool.used == used - 2 and int(tokens.kept[0]) == int(tokens.region[0]) == 4
    assert int(tokens.prompt_of[0]) == 8  # its limits count from its prefill still
    tokens.compress(0, 2, lambda scores: select_heavy_recent(scores, 0, 2), restart_limits=True)
    assert int(tokens.prompt_of[0]) == 9  # now from here


def test_fork_copies_and_the_copy_is_independent():
    tokens = make()
    prefill(tokens, 0, SCORES)
    compact_uniform(tokens, 0, keep=6, recent=2)
    tokens.fork(0, 1)
    assert tokens.kept_positions(0, 1) == tokens.kept_positions(0, 0) and aligned(tokens, 1)
    assert set(tokens.kv.table(0).blocks).isdisjoint(tokens.kv.table(1).blocks)
    before = tokens.kept_positions(0, 1)
    decode_step(tokens, [0], torch.zeros(1, 2), lambda seen, prompt: (6, 2))
    assert tokens.kept_positions(0, 0) != before and tokens.kept_positions(0, 1) == before
    assert int(tokens.seen[1]) == 8 and int(tokens.seen[0]) == 9


def test_release_frees_the_rows_blocks_and_counts():
    tokens = make()
    prefill(tokens, 0, torch.rand(2, 9))
    prefill(tokens, 1, torch.rand(2, 5))
    compact_uniform(tokens, 0, keep=5, recent=1)
    tokens.release(0)
    tokens.release(1)  # in the middle of its prefill
    assert tokens.kv.pool.used == 0 and tokens.filling == {} and tokens.held_slots() == 0
    assert not any(int(x.abs().sum()) for x in (tokens.kept, tokens.region, tokens.seen, tokens.write_slot,
                                                tokens.prompt_of, tokens.delta))


def test_a_later_prompt_starts_after_the_kept_entries_in_position_order():
    tokens = make()
    prefill(tokens, 0, SCORES)
    compact_uniform(tokens, 0, keep=8, recent=2)
    decode_step(tokens, [0], torch.zeros(1, 2), lambda seen, prompt: (8, 2))  # position 8 took a freed slot
    tokens.open_prompt(0, 4)
    assert tokens.filling[0] == 8 and int(tokens.kept[0]) == 0
    order = tokens.positions[:, :, tokens.kv.slots(0, 0, 8)]
    assert (order.diff(dim=-1) > 0).all() and aligned(tokens, 0)


def test_per_head_counts_keep_each_heads_own_count_and_empty_the_rest():
    tokens = make(per_head_counts=True)
    prefill(tokens, 0, SCORES)
    scores = tokens.prompt_scores(0)
    counts = torch.tensor([[5, 3], [5, 3]])  # head 0 keeps 3 heavy and the 2 recent, head 1 one heavy and them
    tokens.compact(0, select_per_head(scores, counts - 2, 2), counts, keep=4)
    assert tokens.kept_positions(0, 0) == [{0, 2, 4, 6, 7}, {1, 6, 7}]
    assert tokens.delta[:, 0].tolist() == [[1, -1], [1, -1]] and tokens.held_slots() == 5
    assert aligned(tokens, 0)
