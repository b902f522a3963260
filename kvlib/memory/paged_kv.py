"""Keys and values in a head-major pool of fixed-size blocks: the storage the block-holding policies share (`paged`;
H2O, StreamingLLM and SnapKV through kvlib.policies.scored_eviction), so that a row takes blocks as it grows and
gives them back when it shrinks or leaves, and a scheduler can admit requests while blocks are free.

The block bookkeeping (free list, reference counts, tables, prefix hashes, copy-on-write) is kvlib.memory.block_pool's;
this module holds the tensors those blocks index: per layer and KV head one stretch of `num_blocks x block_size` slots
(head-major, as vLLM's CPU cache: a run of consecutive blocks is a plain view per head), and optional per-slot arrays
beside them (the scored-eviction policies' scores and original positions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from kvlib.errors import UserError
from kvlib.memory.block_pool import BlockPool, BlockTable, PoolRoom

SERVING_UTILIZATION = 0.9  # vLLM's default gpu_memory_utilization: the share of a capacity its pool and weights take


def check_pool_settings(block_size, num_blocks) -> None:
    """One clear error for a block-holding policy's pool settings (a profile's or the command line's)."""
    if not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1):
        raise UserError(f"block_size must be a power of two >= 1, got {block_size!r}")
    if num_blocks is not None and (not isinstance(num_blocks, int) or num_blocks < 1):
        raise UserError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")


def serving_pool_bytes(capacity: int, weights: int) -> int:
    """The bytes a pool gets when it serves under a device capacity: what vLLM's default utilization leaves after the
    weights (kvlib.backends.vllm sizes the real vLLM's pool by the same rule), the rest left to activations."""
    return int(SERVING_UTILIZATION * capacity) - weights


@dataclass
class PerSlot:
    """An array beside the keys and values, one entry per slot: its dtype and the value a fresh pool holds."""

    dtype: torch.dtype
    fill: float | int


@dataclass
class PerBlock:
    """An array beside the keys and values, one [L, *shape] entry per block (Quest's key bounds)."""

    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class PagedKV:
    keys: torch.Tensor  # [L, Hkv, num_blocks x block_size, D]
    values: torch.Tensor
    per_slot: dict[str, torch.Tensor]  # name -> [L, Hkv, num_blocks x block_size]
    per_block: dict[str, torch.Tensor]  # name -> [L, num_blocks, *shape]
    pool: BlockPool
    tables: dict[int, BlockTable] = field(default_factory=dict)

    @classmethod
    def allocate(cls, spec, device, num_blocks: int, block_size: int, per_slot: dict[str, PerSlot] | None = None,
                 per_block: dict[str, PerBlock] | None = None) -> PagedKV:
        shape = (spec.num_layers, spec.num_kv_heads, num_blocks * block_size)
        keys = torch.zeros((*shape, spec.head_dim), dtype=spec.dtype, device=device)
        slot = {name: torch.full(shape, s.fill, dtype=s.dtype, device=device) for name, s in (per_slot or {}).items()}
        block = {name: torch.zeros((spec.num_layers, num_blocks, *b.shape), dtype=b.dtype, device=device)
                 for name, b in (per_block or {}).items()}
        return cls(keys, torch.zeros_like(keys), slot, block,
                   BlockPool(num_blocks, block_size, cls.block_bytes(spec, block_size, per_slot, per_block)))

    @staticmethod
    def block_bytes(spec, block_size: int, per_slot: dict[str, PerSlot] | None = None,
                    per_block: dict[str, PerBlock] | None = None) -> int:
        """One block's bytes over every layer: keys, values and the per-slot and per-block arrays."""
        def size(dtype):
            return torch.empty((), dtype=dtype).element_size()
        slot = sum(size(s.dtype) for s in (per_slot or {}).values())
        block = sum(size(b.dtype) * math.prod(b.shape) for b in (per_block or {}).values())
        return spec.num_layers * (block_size * spec.num_kv_heads * (2 * spec.head_dim * spec.dtype_bytes + slot)
                                  + block)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def slot_bytes(self) -> int:
        """Keys and values of one slot over every layer and KV head (the per-slot arrays apart)."""
        return self.keys[:, :, 0].nbytes * 2

    def kv_bytes(self) -> int:
        """The pool's keys and values (the arrays beside them apart)."""
        return self.keys.nbytes + self.values.nbytes

    def table(self, row: int) -> BlockTable:
        return self.tables.setdefault(row, BlockTable())

    def reserve(self, row: int, tokens: int) -> None:
        """Room for the row's first `tokens` slots, a shared last block about to be written copied first; raises
        OutOfBlocks where the pool is short (a scheduler asks `room` before the pass)."""
        self.pool.reserve(self.table(row), tokens)
        bs = self.block_size
        for src, dst in self.pool.copies:
            for cache in (self.keys, self.values, *self.per_slot.values()):
                cache[:, :, dst * bs:(dst + 1) * bs] = cache[:, :, src * bs:(src + 1) * bs]
            for array in self.per_block.values():
                array[:, dst] = array[:, src]
        self.pool.copies.clear()

    def room(self, growths: list[tuple[int, int]]) -> PoolRoom:
        """What reserving each (row, tokens) in turn would take from the pool, against what it has free."""
        return self.pool.room([(self.tables.get(row, BlockTable()), tokens) for row, tokens in growths])

    def slots(self, row: int, begin: int, end: int) -> torch.Tensor:
        """The flat slot indices of the row's slots [begin, end) (on the pool's device)."""
        t = torch.arange(begin, end)
        blocks = torch.tensor(self.tables[row].blocks if row in self.tables else [], dtype=torch.long)
        return (blocks[t // self.block_size] * self.block_size + t % self.block_size).to(self.keys.device)

    def table_tensor(self, rows: list[int], width: int | None = None) -> torch.Tensor:
        """[B, W] block tables of the rows, padded with block 0 (never read past a row's length), on the CPU."""
        tables = [self.tables[row].blocks for row in rows]
        width = max(width or 0, max(map(len, tables)))
        # through numpy: torch.tensor of nested lists takes ~0.1 us an entry, ~0.1 ms a step at 8 x 2,048 tokens
        return torch.from_numpy(np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int64))

    def one_run(self, row: int, tokens: int) -> int | None:
        """The first slot of the row's first `tokens` slots where their blocks are consecutive (a plain view), else
        None."""
        blocks = self.tables[row].blocks[:-(-tokens // self.block_size)]
        if all(b == blocks[0] + i for i, b in enumerate(blocks)):
            return blocks[0] * self.block_size
        return None

    def truncate(self, row: int, tokens: int) -> None:
        """Give back the row's blocks past its first `tokens` slots."""
        table = self.tables[row]
        keep = -(-tokens // self.block_size)
        for block in reversed(table.blocks[keep:]):
            self.pool.release(block)
        del table.blocks[keep:]
        del table.hashes[keep:]
        table.tokens = min(table.tokens, tokens)

    def release(self, row: int) -> None:
        if row in self.tables:
            self.pool.free_table(self.tables.pop(row))

    def share(self, src: int, dst: int) -> None:
        """dst shares src's blocks; a shared block is copied only when one of them writes into it."""
        self.release(dst)
        self.tables[dst] = self.pool.fork(self.tables[src])

    def used_bytes(self) -> int:
        return self.pool.used * self.pool.block_bytes

    def total_bytes(self) -> int:
        return self.pool.num_blocks * self.pool.block_bytes
