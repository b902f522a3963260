"""The memory-management paradigm (vLLM's PagedAttention) inside kvlib's engine.

Every key and value stays on the device, in a pool of fixed-size blocks preallocated up front; each row has a block
table. Full prompt blocks are shared between rows with the same prefix (kvlib.block_pool), shared blocks are copied
before they are written, and memory grows a block at a time, so rows of different lengths waste at most one partly
filled block each instead of a reservation for the longest row.

Attention gathers a row's blocks through its block table (on a GPU vLLM does this inside its kernel; here it is an
indexed copy) and masks each row to its own length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.attention import decode_mask, fused_attention, prefill_attention
from kvlib.block_pool import BlockPool, BlockTable
from kvlib.errors import UserError
from kvlib.policies.base import KVPolicy, Step
from kvlib.policies.registry import register


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
            # token-major blocks: gathering a row's blocks is one copy that is already [tokens, heads, dim]
            shape = (s.num_layers, blocks, bs, s.num_kv_heads, s.head_dim)
            self.pool = None  # until the pool fits the device
            self.ledger.add("device", "kv_reserved", blocks * block_bytes, where="paged KV pool")
            self.keys = torch.zeros(shape, dtype=s.dtype, device=self.device)
            self.values = torch.zeros_like(self.keys)
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
            self.keys[:, dst] = self.keys[:, src]
            self.values[:, dst] = self.values[:, src]
        self.pool.copies.clear()
        tables = [self.tables[row].blocks for row in step.rows.tolist()]
        width = max(map(len, tables))
        self.table = torch.tensor([t + [0] * (width - len(t)) for t in tables])  # [B, blocks]
        pos = step.start[:, None] + torch.arange(step.q_len)[None, :]
        # indices live where the cache does: one small copy per step, not one per layer
        self.slot_block = self.table.gather(1, pos // bs).to(self.device)  # [B, T]
        self.slot_offset = (pos % bs).to(self.device)
        self.table = self.table.to(self.device)
        if step.phase == "decode":  # each row sees its own length of the padded gather
            self.visible, self.kv_len = decode_mask(step.start, width * bs, self.device)
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
        kc[self.slot_block, self.slot_offset] = key.transpose(1, 2)
        vc[self.slot_block, self.slot_offset] = value.transpose(1, 2)
        b, s = len(step.rows), self.spec
        blocks = self.table.flatten()
        # the rows' blocks copied out of the pool (vLLM's kernel reads them in place): live while attention runs
        with self.ledger.transient("device", "activations", 2 * len(blocks) * kc[0].nbytes, f"paged gather, layer "
                                   f"{layer}"):
            # index_select copies whole blocks; advanced indexing (kc[table]) took 6x as long on this CPU for the same
            # copy (0.40 vs 0.07 ms for a 2,048-token row), a fifth of a paged decode step at batch 1
            k = kc.index_select(0, blocks).view(b, -1, s.num_kv_heads, s.head_dim).transpose(1, 2)
            v = vc.index_select(0, blocks).view(b, -1, s.num_kv_heads, s.head_dim).transpose(1, 2)
            if step.phase == "prefill":
                n = int(step.start[0]) + step.q_len
                return prefill_attention(query, k[:, :, :n], v[:, :, :n], int(step.start[0]), step.prefill_mode,
                                         self.scale, self.ledger, layer)
            n = self.kv_len
            self.usage.add(layer, step.tokens_seen, step.tokens_seen, b)
            return fused_attention(query, k[:, :, :n], v[:, :, :n], self.visible, self.scale)

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
