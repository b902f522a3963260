"""vLLM-style block management, free of tensors: a pool of fixed-size blocks, reference counts, a free list,
block tables, prefix sharing by chained hashes of full blocks, and copy-on-write.

A full block is findable by the hash of (its parent's hash, its token ids); a hit is verified against the stored token
ids. A block whose last reference goes returns to the free list but stays findable until it is handed out again, so a
request that comes back later can revive it (vLLM's evictor, in LRU order).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from kvlib.errors import DeviceOOM


class OutOfBlocks(DeviceOOM):
    """No free block is left: a scheduler preempts; a static batch records an OOM."""

    def __init__(self, needed: int, free: int, block_bytes: int):
        super().__init__(f"paged KV pool ({needed} blocks needed, {free} free)", needed * block_bytes,
                         0, free * block_bytes)


@dataclass(frozen=True)
class PoolRoom:
    """What a pass would take from a block pool against what it has free: asked by the scheduler before the pass
    (KVPolicy.pool_room), so that a full pool is met before any compute, not from inside the forward pass."""

    needed: int
    free: int
    block_bytes: int

    @property
    def short(self) -> bool:
        return self.needed > self.free

    def error(self) -> OutOfBlocks:
        return OutOfBlocks(self.needed, self.free, self.block_bytes)


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


@dataclass
class BlockTable:
    blocks: list[int] = field(default_factory=list)
    tokens: int = 0  # tokens stored
    hashes: list[int] = field(default_factory=list)  # hash of each full block registered so far


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, block_bytes: int = 0):
        self.num_blocks, self.block_size, self.block_bytes = num_blocks, block_size, block_bytes
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU order
        self.by_hash: dict[int, int] = {}
        self.block_hash: dict[int, int] = {}
        self.block_tokens: dict[int, tuple[int, ...]] = {}
        self.copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write copies the tensor side must perform
        self.hits = self.lookups = 0

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free)

    def allocate(self) -> int:
        if not self.free:
            raise OutOfBlocks(1, 0, self.block_bytes)
        block, _ = self.free.popitem(last=False)
        old = self.block_hash.pop(block, None)  # reused: its old contents are no longer findable
        if old is not None and self.by_hash.get(old) == block:
            del self.by_hash[old]
        self.block_tokens.pop(block, None)
        self.ref[block] = 1
        return block

    def release(self, block: int) -> None:
        self.ref[block] -= 1
        assert self.ref[block] >= 0, f"block {block} released twice"
        if self.ref[block] == 0:
            self.free[block] = None

    def lookup(self, parent: int | None, tokens: tuple[int, ...]) -> int | None:
        """A cached full block with exactly these tokens after this parent, now referenced once more; or None."""
        self.lookups += 1
        h = chain_hash(parent, tokens)
        block = self.by_hash.get(h)
        if block is None or self.block_tokens.get(block) != tokens:
            return None
        if self.ref[block] == 0:
            del self.free[block]  # revived from the free list
        self.ref[block] += 1
        self.hits += 1
        return block

    def register(self, block: int, parent: int | None, tokens: tuple[int, ...]) -> int:
        h = chain_hash(parent, tokens)
        self.by_hash.setdefault(h, block)
        self.block_hash[block] = h
        self.block_tokens[block] = tokens
        return h

    # -- sequences ---------------------------------------------------------------------------------------------
    def prefix_table(self, prompt: list[int]) -> BlockTable:
        """A new table holding the cached full blocks of the prompt's prefix (never its last token)."""
        table = BlockTable()
        bs = self.block_size
        for i in range((len(prompt) - 1) // bs):
            tokens = tuple(prompt[i * bs:(i + 1) * bs])
            block = self.lookup(table.hashes[-1] if table.hashes else None, tokens)
            if block is None:
                break
            table.blocks.append(block)
            table.hashes.append(chain_hash(table.hashes[-1] if table.hashes else None, tokens))
            table.tokens += bs
        return table

    def _growth(self, table: BlockTable, total_tokens: int) -> tuple[int, bool]:
        """(new blocks the table needs to hold total_tokens, whether its last block is shared and about to change)."""
        bs = self.block_size
        needed = max(-(-total_tokens // bs) - len(table.blocks), 0)
        return needed, table.tokens % bs != 0 and total_tokens > table.tokens and self.ref[table.blocks[-1]] > 1

    def room(self, growths: list[tuple[BlockTable, int]]) -> PoolRoom:
        """The free blocks reserving each (table, total_tokens) in turn takes: new blocks, and copies of shared last
        blocks (of k tables sharing one being written, the last one writes it in place once the others have copied)."""
        needed, writers = 0, Counter()
        for table, total in growths:
            new, copy_last = self._growth(table, total)
            needed += new
            if copy_last:
                writers[table.blocks[-1]] += 1
        copies = sum(min(count, self.ref[block] - 1) for block, count in writers.items())
        return PoolRoom(needed + copies, len(self.free), self.block_bytes)

    def reserve(self, table: BlockTable, total_tokens: int) -> None:
        """Make room for the table to hold total_tokens; copy-on-write its last block if shared and about to change."""
        needed, copy_last = self._growth(table, total_tokens)
        if needed + copy_last > len(self.free):
            raise OutOfBlocks(needed + copy_last, len(self.free), self.block_bytes)
        if copy_last:
            src = table.blocks[-1]
            dst = self.allocate()
            self.copies.append((src, dst))
            self.release(src)
            table.blocks[-1] = dst
        for _ in range(needed):
            table.blocks.append(self.allocate())

    def commit(self, table: BlockTable, tokens: list[int], total_tokens: int) -> None:
        """Record that the table now stores total_tokens; register blocks that became full (tokens = its ids)."""
        bs = self.block_size
        for i in range(len(table.hashes), total_tokens // bs):
            if (i + 1) * bs > len(tokens):
                break
            table.hashes.append(self.register(table.blocks[i], table.hashes[-1] if table.hashes else None,
                                              tuple(tokens[i * bs:(i + 1) * bs])))
        table.tokens = total_tokens

    def fork(self, table: BlockTable) -> BlockTable:
        """A child sharing every block of the parent; writes to a shared block are copied first."""
        for block in table.blocks:
            self.ref[block] += 1
        return BlockTable(list(table.blocks), table.tokens, list(table.hashes))

    def free_table(self, table: BlockTable) -> None:
        for block in reversed(table.blocks):  # the tail goes back first: prefixes stay cached longest
            self.release(block)
        table.blocks, table.tokens, table.hashes = [], 0, []
