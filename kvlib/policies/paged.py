"""The memory-management paradigm (vLLM's PagedAttention) inside kvlib's engine.

Every key and value stays on the device, in a pool of fixed-size blocks preallocated up front; each row has a block
table. Full prompt blocks are shared between rows with the same prefix (kvlib.memory.block_pool), shared blocks are copied
before they are written, and memory grows a block at a time, so rows of different lengths waste at most one partly
filled block each instead of a reservation for the longest row.

Decode attention is the one every policy decodes with (kvlib.kernels.decode), through each row's block table: on a
CPU in fp32 the C kernel reads the pool (head-major: each KV head's slots are one stretch) in place; elsewhere (a GPU,
no C compiler) the shared PyTorch path gathers the blocks, as it does every policy's reads. Prefill reads a row in
place when its blocks are one run (a fresh row's usually are) and gathers it otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.errors import UserError
from kvlib.kernels.attention import prefill_attention
from kvlib.kernels.decode import DecodeReads
from kvlib.memory.block_pool import BlockPool, BlockTable
from kvlib.policies.base import KVPolicy, Step
from kvlib.policies.registry import register


def block_runs(blocks: list[int], tokens: int, block_size: int) -> list[tuple[int, int]]:
    """The first `tokens` tokens of a block table as maximal runs of consecutive blocks: (first token's slot in the
    flattened pool, tokens in the run)."""
    runs: list[tuple[int, int]] = []
    held = 0
    for i in range(-(-tokens // block_size)):
        count = min(block_size, tokens - held)
        if runs and blocks[i] == blocks[i - 1] + 1:
            runs[-1] = (runs[-1][0], runs[-1][1] + count)
        else:
            runs.append((blocks[i] * block_size, count))
        held += count
    return runs


@register
@dataclass
class PagedPolicy(KVPolicy):
    name = "paged"
    lossless = True

    block_size: int = 16
    num_blocks: int | None = None  # None: enough for every row's prompt plus max_new_tokens, without sharing
    prefix_caching: bool = True

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise UserError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise UserError(f"num_blocks must be >= 1, got {self.num_blocks}")

    def start(self, batch_size, prompt_lens, max_new_tokens):
        s, bs = self.spec, self.block_size
        self.tables: dict[int, BlockTable] = {}
        self.prompts: dict[int, list[int]] = {}
        blocks = self.num_blocks or sum(-(-(n + max_new_tokens) // bs) for n in prompt_lens)
        smallest = -(-(min(prompt_lens) + 1) // bs)
        if blocks < smallest:
            raise UserError(f"a pool of {blocks} blocks of {bs} tokens cannot hold even one request "
                            f"({min(prompt_lens)} prompt tokens need {smallest} blocks)")
        block_bytes = s.kv_bytes(bs)
        self.prompt_tokens = self.hit_tokens = self.peak_blocks = 0
        if getattr(self, "pool", None) is None or self.pool.num_blocks != blocks:
            # head-major, as vLLM's CPU cache: each head's slots are one stretch, so a span of blocks is a plain view per
            # head (attention over it, SmolLM2's 30 layers, one row of 265-1,024 tokens: 73-206 us a layer against
            # 83-280 token-major, 2 threads; 3-5 % at batch 8-16)
            shape = (s.num_layers, s.num_kv_heads, blocks, bs, s.head_dim)
            self.pool = None  # until the pool fits the device
            self.ledger.add("device", "kv_reserved", blocks * block_bytes, where="paged KV pool")
            self.keys = torch.zeros(shape, dtype=s.dtype, device=self.device)
            self.values = torch.zeros_like(self.keys)
            self.flat_pools = tuple(c.view(s.num_layers, s.num_kv_heads, -1, s.head_dim)
                                    for c in (self.keys, self.values))
            self.pool = BlockPool(blocks, bs, block_bytes)
        else:  # a pool kept from an earlier run keeps its cached prefixes
            self.ledger.add("device", "kv_reserved", blocks * block_bytes, where="paged KV pool")

    # -- block management ----------------------------------------------------------------------------------------
    def reuse_prefix(self, row, prompt):
        if row in self.tables:
            self.release(row)
        self.tables[row] = self.pool.prefix_table(prompt) if self.prefix_caching else BlockTable()
        self.prompts[row] = list(prompt)
        self.prompt_tokens += len(prompt)
        self.hit_tokens += self.tables[row].tokens
        return self.tables[row].tokens

    def prepare(self, step: Step):
        with self.timers.section("block_management"):
            self._prepare(step)

    def _prepare(self, step: Step):
        bs = self.block_size
        for row, start in zip(step.rows.tolist(), step.start.tolist()):
            self.pool.reserve(self.tables.setdefault(row, BlockTable()), start + step.q_len)
        for src, dst in self.pool.copies:  # copy-on-write of a shared block, in every layer
            self.keys[:, :, dst] = self.keys[:, :, src]
            self.values[:, :, dst] = self.values[:, :, src]
        self.pool.copies.clear()
        tables = [self.tables[row].blocks for row in step.rows.tolist()]
        width = max(map(len, tables))
        self.table = torch.tensor([t + [0] * (width - len(t)) for t in tables])  # [B, blocks]
        pos = step.start[:, None] + torch.arange(step.q_len)[None, :]
        # indices live where the cache does: one small copy per step, not one per layer
        self.slots = (self.table.gather(1, pos // bs) * bs + pos % bs).flatten().to(self.device)  # [B x T]
        self.table = self.table.to(self.device)
        if step.phase == "decode":
            self.read = step.start + 1
        self.peak_blocks = max(self.peak_blocks, self.pool.used)

    def release(self, row):
        self.pool.free_table(self.tables.pop(row))
        self.prompts.pop(row, None)

    def fork(self, src, dst):
        """dst shares src's blocks; a shared block is copied only when one of them writes into it."""
        if dst in self.tables:
            self.release(dst)
        self.tables[dst] = self.pool.fork(self.tables[src])
        self.prompts[dst] = list(self.prompts.get(src, []))
        self._book()

    # -- attention -------------------------------------------------------------------------------------------------
    def attend(self, layer, query, key, value, step: Step):
        kc, vc = self.keys[layer], self.values[layer]
        s = self.spec
        for pool, new in zip(self.flat_pools, (key, value)):
            pool[layer].index_copy_(1, self.slots, new.transpose(0, 1).reshape(s.num_kv_heads, -1, s.head_dim))
        if step.phase == "decode":
            self.usage.add(layer, step.tokens_seen, step.tokens_seen, len(step.rows))
            pools = (c[layer] for c in self.flat_pools)
            return self.decode_attention(layer, query, DecodeReads(*pools, self.read, table=self.table,
                                                                   block_size=self.block_size))[0]
        flat_k, flat_v = (pool[layer] for pool in self.flat_pools)
        row, begin = int(step.rows[0]), int(step.start[0])
        n = begin + step.q_len
        runs = block_runs(self.tables[row].blocks, n, self.block_size)
        if len(runs) == 1:  # one run of consecutive blocks: a view into the pool
            first = runs[0][0]
            k, v = (c[:, first:first + n][None] for c in (flat_k, flat_v))
            return prefill_attention(query, k, v, begin, step.prefill_mode, self.scale, self.ledger, layer)
        blocks = self.table[0, :-(-n // self.block_size)]
        with self.ledger.transient("device", "activations", 2 * len(blocks) * kc[:, 0].nbytes,
                                   f"paged prefill gather, layer {layer}"):
            k, v = (c.index_select(1, blocks).view(s.num_kv_heads, -1, s.head_dim)[:, :n][None] for c in (kc, vc))
            return prefill_attention(query, k, v, begin, step.prefill_mode, self.scale, self.ledger, layer)

    def after_pass(self, step: Step):
        with self.timers.section("block_management"):
            for row, start in zip(step.rows.tolist(), step.start.tolist()):
                self.pool.commit(self.tables[row], self.prompts.get(row, []), start + step.q_len)
            self._book()

    def _book(self):
        used = self.pool.used * self.pool.block_bytes
        self.ledger.set("device", "paged block tables", kv=used,
                        kv_reserved=self.pool.num_blocks * self.pool.block_bytes - used,
                        overhead=sum(len(t.blocks) for t in self.tables.values()) * 4)

    def finish(self):
        for row in list(self.tables):
            self.release(row)
        self.ledger.set("device", kv=0, kv_reserved=0, overhead=0)

    def stats(self):
        return {"block_size": self.block_size, "num_blocks": self.pool.num_blocks if self.pool else 0,
                "peak_blocks_used": self.peak_blocks,
                "prefix_hit_rate": self.hit_tokens / max(self.prompt_tokens, 1), "prefix_hit_tokens": self.hit_tokens}
