"""Block management without a model: allocation, reference counts, prefix hashing, revival, copy-on-write."""

import pytest
import torch

from kvlib.memory.block_pool import BlockPool, BlockTable, OutOfBlocks


def filled(pool, tokens):
    table = pool.prefix_table(tokens)
    pool.reserve(table, len(tokens))
    pool.commit(table, tokens, len(tokens))
    return table


def test_allocation_and_free_list():
    pool = BlockPool(4, 2)
    table = BlockTable()
    pool.reserve(table, 5)
    assert len(table.blocks) == 3 and pool.used == 3
    with pytest.raises(OutOfBlocks):
        pool.reserve(table, 9)
    pool.free_table(table)
    assert pool.used == 0


def test_prefix_hits_share_full_blocks_but_never_the_last_token():
    pool = BlockPool(16, 4)
    prompt = list(range(12))
    first = filled(pool, prompt)
    second = pool.prefix_table(prompt)
    assert second.tokens == 8  # 12 tokens = 3 full blocks, but the last token's logits must be computed
    assert second.blocks == first.blocks[:2]
    assert pool.ref[first.blocks[0]] == 2
    other = pool.prefix_table([0, 1, 2, 99] + list(range(4, 12)))
    assert other.tokens == 0  # the first block differs: the chain breaks there


def test_hash_hit_is_verified_against_the_tokens():
    pool = BlockPool(8, 2)
    table = filled(pool, [5, 6, 7, 8, 9])
    block = table.blocks[0]
    pool.block_tokens[block] = (5, 0)  # as if another token pair had collided onto the same hash
    assert pool.prefix_table([5, 6, 7, 8, 9]).tokens == 0


def test_freed_blocks_stay_findable_until_reused():
    pool = BlockPool(4, 2)
    table = filled(pool, [1, 2, 3, 4, 5])
    cached = list(table.blocks[:2])
    pool.free_table(table)
    revived = pool.prefix_table([1, 2, 3, 4, 5])
    assert revived.blocks == cached and pool.ref[cached[0]] == 1 and pool.hits == 2
    pool.free_table(revived)
    churn = BlockTable()
    pool.reserve(churn, 8)  # every block handed out again: the old contents are gone
    pool.free_table(churn)
    assert pool.prefix_table([1, 2, 3, 4, 5]).tokens == 0


def test_copy_on_write_when_a_forked_sequence_writes_a_shared_block():
    pool = BlockPool(8, 4)
    parent = filled(pool, [1, 2, 3, 4, 5, 6])  # second block half full
    child = pool.fork(parent)
    assert pool.ref[parent.blocks[1]] == 2
    pool.reserve(child, 7)  # the child writes token 7 into the shared, partly filled block
    assert pool.copies == [(parent.blocks[1], child.blocks[1])]
    assert child.blocks[0] == parent.blocks[0] and child.blocks[1] != parent.blocks[1]
    assert pool.ref[parent.blocks[1]] == 1 and pool.ref[parent.blocks[0]] == 2
    pool.copies.clear()
    pool.reserve(parent, 7)  # the parent's block is its own again: no copy
    assert pool.copies == []


def test_paged_kv_maps_a_rows_slots_through_its_blocks_and_gives_blocks_back():
    from types import SimpleNamespace

    from kvlib.memory.paged_kv import PagedKV, PerSlot

    spec = SimpleNamespace(num_layers=2, num_kv_heads=3, head_dim=4, dtype=torch.float32, dtype_bytes=4)
    kv = PagedKV.allocate(spec, "cpu", num_blocks=8, block_size=4, per_slot={"pos": PerSlot(torch.long, -1)})
    assert kv.pool.block_bytes == PagedKV.block_bytes(spec, 4, {"pos": PerSlot(torch.long, -1)}) == 4 * 2 * 3 * (32 + 8)
    assert (kv.per_slot["pos"] == -1).all() and kv.per_slot["pos"].shape == (2, 3, 32)
    kv.reserve(0, 5)  # blocks 0, 1
    kv.reserve(1, 3)  # block 2
    kv.reserve(0, 9)  # block 3: row 0's blocks are 0, 1, 3
    assert kv.tables[0].blocks == [0, 1, 3]
    assert kv.slots(0, 3, 10).tolist() == [3, 4, 5, 6, 7, 12, 13]
    assert kv.one_run(0, 8) == 0 and kv.one_run(0, 9) is None and kv.one_run(1, 3) == 8
    assert kv.table_tensor([1, 0]).tolist() == [[2, 0, 0], [0, 1, 3]]
    kv.truncate(0, 4)
    assert kv.tables[0].blocks == [0] and kv.pool.used == 2
    kv.release(0), kv.release(1)
    assert kv.pool.used == 0


@pytest.mark.parametrize("writers", [1, 2, 3])
def test_the_room_a_step_asks_for_is_what_reserving_its_rows_takes(writers):
    """Three tables share a partly filled last block (a prompt forked twice): each one that writes into it copies it
    while another still holds it, so k writers of 3 copy min(k, 2) times; with a new block each, the room asked
    before the step (BlockPool.room) is what reserving them in turn takes, and a pool one block short is short."""
    pool = BlockPool(16, 4)
    parent = filled(pool, list(range(6)))  # 6 tokens: one full block and a partial one
    tables = [parent, pool.fork(parent), pool.fork(parent)]
    growths = [(table, 9) for table in tables[:writers]]  # 3 more tokens each: into the shared block and a new one
    room = pool.room(growths)
    assert room.needed == writers + min(writers, 2) and room.free == pool.num_blocks - pool.used and not room.short
    free = len(pool.free)
    for table, total in growths:
        pool.reserve(table, total)
    assert free - len(pool.free) == room.needed
    assert BlockPool(room.needed - 1, 4).room([(BlockTable(), 4 * room.needed)]).short
