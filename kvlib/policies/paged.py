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
from kvlib.memory.block_pool import BlockTable
from kvlib.memory.paged_kv import PagedKV, check_pool_settings
from kvlib.policies.base import KVPolicy, Step
from kvlib.policies.fidelity import Fidelity, Rule, Source
from kvlib.policies.registry import register


@register
@dataclass
class PagedPolicy(KVPolicy):
    name = "paged"
    lossless = True
    shares_forks = True
    adopts_prefill = True

    block_size: int = 16
    num_blocks: int | None = None  # None: enough for every row's prompt plus max_new_tokens, without sharing (or,
    # when serving under a device capacity, what the capacity leaves: KVPolicy.pool_blocks)
    prefix_caching: bool = True

    fidelity = Fidelity(Source("vllm-project/vllm", "003df2961dd8830c317a61f9745ccd557da9fa06",
                               "vllm/v1/core/kv_cache_manager.py, vllm/v1/core/block_pool.py, "
                               "vllm/v1/core/sched/scheduler.py"), rules=(
        Rule("block size", 16, setting="block_size"),
        Rule("prefix caching", True, setting="prefix_caching"),
        Rule("prefix hit", "full blocks by chained hash, never the prompt's last token",
             kvlib="full blocks by chained hash, never the prompt's last token"),
        Rule("hash check", "none (sha256 or the builtin hash)", kvlib="the builtin hash, tokens compared on a hit",
             differs="Python's hash can collide; a verified hit is the same hit"),
        Rule("freed blocks", "LRU free queue, findable until reused", kvlib="LRU free queue, findable until reused"),
        Rule("forks", "share full blocks through the prefix cache (V1)",
             kvlib="share every block, the partial one copied on write",
             differs="kvlib forks rows (answer choices, questions off a conversation) as vLLM V0's block manager did"),
        Rule("preemption", "recompute, the newest running request first",
             kvlib="recompute, the newest running request first"),
        Rule("a full pool", "met before the step: the scheduler asks for the step's blocks, none run short",
             kvlib="met before the step: the scheduler asks for the step's blocks, none run short"),
        Rule("pool size", "gpu_memory_utilization (0.9) of the device less weights and activations",
             kvlib="the batch's prompts + max_new_tokens, or what a configured capacity leaves",
             differs="the study sizes the pool to its batch, or to the device capacity a profile configures"),
        Rule("decode kernel", "PagedAttention / FlashAttention (CUDA)",
             kvlib="kvlib's one decode kernel through the block table (C on a CPU)",
             differs="one kernel for every policy, so a difference is a policy's"),
    ), note="vLLM V1's KV cache manager and scheduler (the continuous schedule is kvlib.engine.scheduler's); the "
            "real vLLM runs beside it as the outside baseline")

    def __post_init__(self):
        check_pool_settings(self.block_size, self.num_blocks)

    def start(self, batch_size, prompt_lens, max_new_tokens):
        s, bs = self.spec, self.block_size
        self.prompts: dict[int, list[int]] = {}
        block_bytes = s.kv_bytes(bs)
        blocks = self.num_blocks or self.pool_blocks(sum(-(-(n + max_new_tokens) // bs) for n in prompt_lens),
                                                     block_bytes)
        smallest = -(-(min(prompt_lens) + 1) // bs)
        if blocks < smallest:
            raise UserError(f"a pool of {blocks} blocks of {bs} tokens cannot hold even one request "
                            f"({min(prompt_lens)} prompt tokens need {smallest} blocks)")
        self.prompt_tokens = self.hit_tokens = self.peak_blocks = 0
        self.ledger.add("device", "kv_reserved", blocks * block_bytes, where="paged KV pool")
        if getattr(self, "kv", None) is None or self.kv.pool.num_blocks != blocks:
            # head-major, as vLLM's CPU cache: each head's slots are one stretch, so a span of blocks is a plain view per
            # head (attention over it, SmolLM2's 30 layers, one row of 265-1,024 tokens: 73-206 us a layer against
            # 83-280 token-major, 2 threads; 3-5 % at batch 8-16)
            self.kv = None  # until the pool fits the device
            self.kv = PagedKV.allocate(s, self.device, blocks, bs)
        # else: a pool kept from an earlier run keeps its cached prefixes

    @property
    def tables(self) -> dict[int, BlockTable]:
        return self.kv.tables

    # -- block management ----------------------------------------------------------------------------------------
    def reuse_prefix(self, row, prompt):
        self.kv.release(row)
        self.tables[row] = self.kv.pool.prefix_table(prompt) if self.prefix_caching else BlockTable()
        self.prompts[row] = list(prompt)
        self.prompt_tokens += len(prompt)
        self.hit_tokens += self.tables[row].tokens
        return self.tables[row].tokens

    def prepare(self, step: Step):
        with self.timers.section("block_management"):
            self._prepare(step)

    def _prepare(self, step: Step):
        bs = self.block_size
        for row, end in step.row_ends:
            self.kv.reserve(row, end)
        table = self.kv.table_tensor(step.rows.tolist())  # [B, blocks]
        pos = step.start[:, None] + torch.arange(step.q_len)[None, :]
        # indices live where the cache does: one small copy per step, not one per layer
        self.slots = (table.gather(1, pos // bs) * bs + pos % bs).flatten().to(self.device)  # [B x T]
        self.table = table.to(self.device)
        if step.phase == "decode":
            self.read = step.start + 1
        self.peak_blocks = max(self.peak_blocks, self.kv.pool.used)

    def pool_room(self, step: Step):
        with self.timers.section("block_management"):
            return self.kv.room(step.row_ends)

    def release(self, row):
        self.kv.release(row)
        self.prompts.pop(row, None)

    def fork(self, src, dst):
        """dst shares src's blocks; a shared block is copied only when one of them writes into it."""
        self.kv.share(src, dst)
        self.prompts[dst] = list(self.prompts.get(src, []))
        self._book()

    # -- attention -------------------------------------------------------------------------------------------------
    def attend(self, layer, query, key, value, step: Step):
        s = self.spec
        keys, values = self.kv.keys[layer], self.kv.values[layer]  # [Hkv, slots, D]
        self._write(layer, key, value)
        if step.phase == "decode":
            self.usage.add(layer, step.tokens_seen, step.tokens_seen, len(step.rows))
            return self.decode_attention(layer, query, DecodeReads(keys, values, self.read, table=self.table,
                                                                   block_size=self.block_size))[0]
        row, begin = int(step.rows[0]), int(step.start[0])
        n = begin + step.q_len
        first = self.kv.one_run(row, n)
        if first is not None:  # one run of consecutive blocks: a view into the pool
            k, v = (c[:, first:first + n][None] for c in (keys, values))
            return prefill_attention(query, k, v, begin, step.prefill_mode, self.scale, self.ledger, layer)
        with self.ledger.transient("device", "activations", n * self.kv.slot_bytes // s.num_layers,
                                   f"paged prefill gather, layer {layer}"):
            slots = self.kv.slots(row, 0, n)
            k, v = (c.index_select(1, slots)[None] for c in (keys, values))
            return prefill_attention(query, k, v, begin, step.prefill_mode, self.scale, self.ledger, layer)

    def _write(self, layer, key, value):
        """The pass's keys/values [B, Hkv, T, D] into their slots (prepare found them)."""
        s = self.spec
        for pool, new in ((self.kv.keys[layer], key), (self.kv.values[layer], value)):
            pool.index_copy_(1, self.slots, new.transpose(0, 1).reshape(s.num_kv_heads, -1, s.head_dim))

    def adopt_pass(self, layer, recorded, step: Step):
        self._write(layer, recorded.key(layer), recorded.value(layer))

    def after_pass(self, step: Step):
        with self.timers.section("block_management"):
            for row, end in step.row_ends:
                self.kv.pool.commit(self.tables[row], self.prompts.get(row, []), end)
            self._book()

    def _book(self):
        used = self.kv.used_bytes()
        self.ledger.set("device", "paged block tables", kv=used, kv_reserved=self.kv.total_bytes() - used,
                        overhead=sum(len(t.blocks) for t in self.tables.values()) * 4)

    def finish(self):
        for row in list(self.tables if getattr(self, "kv", None) is not None else ()):
            self.release(row)
        self.ledger.set("device", kv=0, kv_reserved=0, overhead=0)

    def stats(self):
        return {"block_size": self.block_size, "num_blocks": self.kv.pool.num_blocks if self.kv else 0,
                "peak_blocks_used": self.peak_blocks,
                "prefix_hit_rate": self.hit_tokens / max(self.prompt_tokens, 1), "prefix_hit_tokens": self.hit_tokens}
