"""The memory-management paradigm (vLLM's PagedAttention) inside kvlib's engine.

Every key and value stays on the device, in a pool of fixed-size blocks preallocated up front; each row has a block
table. Full prompt blocks are shared between rows with the same prefix (kvlib.block_pool), shared blocks are copied
before they are written, and memory grows a block at a time, so rows of different lengths waste at most one partly
filled block each instead of a reservation for the longest row.

Decode attention reads the pool in place, each row over its own length (kvlib.attention.paged_decode_attention): a
row's blocks are cut into runs of consecutive block ids; each run of at least IN_PLACE_MIN_TOKENS tokens is attended as a
strided view into the pool, and the few tokens outside such runs (the blocks a row grew by during decode, which sit
after every other row's prompt blocks) are gathered for the whole batch into one small tensor and attended in one
masked call; the parts are merged by their log-sum-exp. Prefill reads a row in place when its blocks are one run (a
fresh row's usually are) and gathers it otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.attention import PagedLayout, paged_decode_attention, prefill_attention
from kvlib.block_pool import BlockPool, BlockTable
from kvlib.errors import UserError
from kvlib.policies.base import KVPolicy, Step
from kvlib.policies.registry import register

# A run of consecutive blocks shorter than this is gathered with the tail: one more attention call per row and layer
# costs ~30 us on this CPU, copying 64 tokens of K and V (24 KiB for SmolLM2) less.
IN_PLACE_MIN_TOKENS = 64


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


def decode_layout(tables: list[list[int]], lengths: list[int], block_size: int, device) -> PagedLayout:
    """Where a decode step's rows lie in the pool: long runs read in place, the other tokens' slots gathered."""
    in_place, tails = [], []
    for blocks, n in zip(tables, lengths):
        runs = block_runs(blocks, n, block_size)
        in_place.append([run for run in runs if run[1] >= IN_PLACE_MIN_TOKENS])
        tails.append([slot for first, count in runs if count < IN_PLACE_MIN_TOKENS
                      for slot in range(first, first + count)])
    width = max(map(len, tails))
    if width == 0:
        return PagedLayout(in_place, None, None)
    index = torch.tensor([t + [0] * (width - len(t)) for t in tails])
    visible = torch.arange(width)[None, :] < torch.tensor([len(t) for t in tails])[:, None]
    return PagedLayout(in_place, index.to(device), visible.to(device))


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
            self.flat_pools = tuple(c.view(s.num_layers, -1, s.num_kv_heads, s.head_dim)
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
        if step.phase == "decode":
            self.layout = decode_layout([self.tables[row].blocks for row in step.rows.tolist()],
                                        (step.start + 1).tolist(), bs, self.device)
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
        s = self.spec
        if step.phase == "decode":
            self.usage.add(layer, step.tokens_seen, step.tokens_seen, len(step.rows))
            tail = self.layout.tail_index
            # the tail's tokens copied out of the pool (at most a few blocks a row): live while attention runs
            nbytes = 0 if tail is None else 2 * tail.numel() * self.flat_pools[0][0, 0].nbytes
            with self.ledger.transient("device", "activations", nbytes, f"paged tail gather, layer {layer}"):
                return paged_decode_attention(query, *self.flat_pools, self.layout, self.scale, layer)
        flat_k, flat_v = kc.view(-1, s.num_kv_heads, s.head_dim), vc.view(-1, s.num_kv_heads, s.head_dim)
        row, begin = int(step.rows[0]), int(step.start[0])
        n = begin + step.q_len
        runs = block_runs(self.tables[row].blocks, n, self.block_size)
        if len(runs) == 1:  # one run of consecutive blocks: a view into the pool
            first = runs[0][0]
            k, v = (c[first:first + n].transpose(0, 1)[None] for c in (flat_k, flat_v))
            return prefill_attention(query, k, v, begin, step.prefill_mode, self.scale, self.ledger, layer)
        blocks = self.table[0, :-(-n // self.block_size)]
        with self.ledger.transient("device", "activations", 2 * len(blocks) * kc[0].nbytes,
                                   f"paged prefill gather, layer {layer}"):
            k, v = (c.index_select(0, blocks).view(-1, s.num_kv_heads, s.head_dim)[:n].transpose(0, 1)[None]
                    for c in (kc, vc))
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
