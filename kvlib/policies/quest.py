"""Quest (Tang et al., ICML 2024): query-aware selection of KV pages; all of the cache is kept, a budget of it is read.

Keys and values live in a paged pool (kvlib.memory.block_pool: fixed-size blocks, a block table per row, blocks allocated as
a row grows). For every block Quest also keeps, per KV head, the channel-wise minimum and maximum of its keys. At each
decode step, in every layer after the first `dense_layers`, the query bounds each block's attention logit from above:
sum over channels of max(q_d x max_d, q_d x min_d) >= q.k for any key of the block. Each KV head reads
tokens_allowed(seen) // block_size blocks (at least one), as the official kernels' page budget is token_budget //
page_size: the row's last block, which holds the new token, and the best of the others by that bound; a budget that
covers the row reads all of it. Attention runs over those blocks only. Prefill is dense.

Memory is not saved: every key and value stays in the pool, plus 2 x head_dim numbers a block and KV head of
metadata (booked as overhead). What Quest saves is what a decode step reads: `stats()` reports the KV bytes a step's
attention read (the selected blocks of the sparse layers, every token of the dense ones, and the metadata of every
block the estimate scanned) against what a full read would be, and `kv_share_attended` the tokens attended.

Read: mit-han-lab/Quest (`quest/models/llama.py` and `quest/utils/controller.py`, the kernels' path: page_size 16,
page budget token_budget // page_size with the last page always one of them, criticality max(q * max_key, q *
min_key).sum(-1), layers 0 and 1 dense; `evaluation/quest_attention.py`, the accuracy scripts' emulation, selects per
query head, at least 3 pages, the last page not forced). Deviations:
- One selection per KV head under GQA: a block's bound is the largest over the query heads of its group, so the
  block is read if any of them may need it. The official code targets multi-head attention (one selection per query
  head); for a grouped KV head a per-query-head selection would read the union of the group's picks, which the budget
  would then not bound.
- The budget is kvlib's share of the tokens seen (or `budget_tokens`) instead of an absolute token_budget, cut to
  whole blocks as the kernels cut theirs; budget 1.0 reads every block.
- The pool is head-major (each KV head's slots one stretch, as `paged`'s): decode attention (kvlib.kernels.decode, the
  kernel every policy shares) reads each KV head's selected blocks in place through a block list per row and head,
  as the official CUDA kernels read only the selected pages; the dense layers read each row's whole block table.
- Where decode attention runs kvlib's C kernel (a CPU in fp32: the machine's choice, `decode_attention` in stats),
  the scoring, the top-k and the block lists are one C call (kvlib.kernels.cpu_kernel.quest_select); elsewhere
  (a GPU, another dtype, KVLIB_CPU_KERNELS=torch) PyTorch ops (`select_blocks`, `selected_blocks`) choose the same
  blocks. Equal bounds go to the earlier block on both.
- No prefix sharing between rows (kvlib's `paged` policy has it); forks share blocks copy-on-write through the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.errors import UserError
from kvlib.kernels import cpu_kernel
from kvlib.kernels.attention import prefill_attention
from kvlib.kernels.decode import DecodeReads
from kvlib.memory.paged_kv import PagedKV, PerBlock, check_pool_settings
from kvlib.policies.base import BudgetedPolicy, Step
from kvlib.policies.fidelity import Fidelity, Rule, Source
from kvlib.policies.registry import register


@register
@dataclass
class QuestPolicy(BudgetedPolicy):
    name = "quest"
    adopts_prefill = True
    shares_forks = True
    reads = "the blocks whose key bounds score highest for the query, each step"

    block_size: int = 16  # the official page_size
    dense_layers: int = 2
    num_blocks: int | None = None  # None: enough for the batch (or, when serving, what the device capacity leaves)

    fidelity = Fidelity(Source("mit-han-lab/Quest", "01c1623bf9395009520874e989e29f683203b357",
                               "quest/models/llama.py, quest/utils/controller.py, evaluation/quest_attention.py"),
                        rules=(
        Rule("page size", 16, setting="block_size"),
        Rule("dense layers", 2, setting="dense_layers"),
        Rule("budget", "token_budget tokens", kvlib="budget x tokens seen (budget_tokens: absolute)",
             differs="a share of the tokens seen, kvlib's one budget rule"),
        Rule("pages read", "token_budget // page_size, the last page one of them",
             kvlib="token_budget // page_size, the last page one of them"),
        Rule("a budget that covers the row", "token_budget // page_size pages (all if no more)", kvlib="every page",
             differs="budget 1.0 is the full cache, as for every policy"),
        Rule("page bound", "sum over channels of max(q x min, q x max)",
             kvlib="sum over channels of max(q x min, q x max)"),
        Rule("selection per", "attention head (MHA)", kvlib="KV head, the largest bound of its query heads",
             differs="under GQA a query head's own picks would read their union, which no budget bounds"),
        Rule("prefill", "dense", kvlib="dense"),
        Rule("what is kept", "every entry", kvlib="every entry"),
    ), note="the kernels' path (a budget under one page reads the last page, where the kernels need one page); the "
            "accuracy scripts' emulation (evaluation/quest_attention.py) selects per query head, at least 3 pages, "
            "the last page not forced")

    def __post_init__(self):
        super().__post_init__()
        check_pool_settings(self.block_size, self.num_blocks)
        if not isinstance(self.dense_layers, int) or self.dense_layers < 0:
            raise UserError(f"dense_layers must be an integer >= 0, got {self.dense_layers!r}")

    # -- storage ---------------------------------------------------------------------------------------------------
    def start(self, batch_size, prompt_lens, max_new_tokens):
        s, bs = self.spec, self.block_size
        self.bytes_read_full = self.peak_blocks = 0
        bounds = {name: PerBlock(s.dtype, (s.num_kv_heads, s.head_dim)) for name in ("key_min", "key_max")}
        block_bytes = PagedKV.block_bytes(s, bs, per_block=bounds)
        blocks = self.num_blocks or self.pool_blocks(sum(-(-(n + max_new_tokens) // bs) for n in prompt_lens),
                                                     block_bytes)
        self.kv = None  # until the pool fits the device: finish() then has nothing to free
        self.ledger.add("device", "kv_reserved", s.kv_bytes(blocks * bs), where="quest KV pool")
        self.ledger.add("device", "overhead", blocks * (block_bytes - s.kv_bytes(bs)), where="quest block min/max")
        self.kv = PagedKV.allocate(s, self.device, blocks, bs, per_block=bounds)
        self.key_min, self.key_max = self.kv.per_block["key_min"], self.kv.per_block["key_max"]  # [L, blocks, Hkv, D]

    @property
    def tables(self):
        return self.kv.tables

    def pool_room(self, step: Step):
        with self.timers.section("block_management"):
            return self.kv.room(step.row_ends)

    def prepare(self, step: Step):
        with self.timers.section("block_management"):
            bs = self.block_size
            rows, starts = step.rows.tolist(), step.start.tolist()
            for row, end in step.row_ends:
                self.kv.reserve(row, end)  # a block shared by a fork is copied, its bounds included
            self.peak_blocks = max(self.peak_blocks, self.kv.pool.used)
            table = self.kv.table_tensor(rows)  # [B, blocks]
            counts = [len(self.tables[row].blocks) for row in rows]
            pos = step.start[:, None] + torch.arange(step.q_len)[None, :]
            blocks = table.gather(1, pos // bs).flatten().to(self.device)  # [B x T], the pass's tokens in order
            offsets = (pos % bs).flatten().to(self.device)
            # what every layer's _write uses, made once a pass: each token's slot, and the index of its block for
            # the min/max; a block's first token starts its bounds afresh, in every layer at once
            self.slots = blocks * bs + offsets
            self.bound_index = blocks[:, None, None].expand(-1, self.spec.num_kv_heads, self.spec.head_dim)
            fresh = blocks[offsets == 0]
            if len(fresh):
                self.key_min[:, fresh] = float("inf")
                self.key_max[:, fresh] = float("-inf")
            self.table = table.to(self.device)
            self.row_blocks = torch.tensor(counts)
            if step.phase == "decode":
                seen = [start + 1 for start in starts]
                pages = [self.pages_read(n) for n in seen]
                self.seen, self.pages = torch.tensor(seen), torch.tensor(pages)
                # each KV head of a row reads min(pages, blocks) blocks, the last one up to the row's length, in
                # every sparse layer: the block lists' width, and the tokens a layer attends per KV head
                picks = [min(p, c) for p, c in zip(pages, counts)]
                self.picks = max(picks)
                self.attended = sum((p - 1) * bs + n - (c - 1) * bs for p, n, c in zip(picks, seen, counts))

    def pages_read(self, seen: int) -> int:
        """The blocks a KV head reads in a row of `seen` tokens: the official page budget token_budget // page_size
        (quest/models/llama.py), the last page one of them; at least that page, and the whole row where the budget
        covers it (the kernels read every page while the row is within its page budget)."""
        budget = self.tokens_allowed(seen)
        if budget >= seen:
            return -(-seen // self.block_size)
        return max(1, budget // self.block_size)

    def _write(self, layer, key, value):
        """Store the pass's keys/values and fold them into their blocks' channel-wise min/max."""
        s, slots = self.spec, self.slots
        self.kv.keys[layer].index_copy_(1, slots, key.transpose(0, 1).reshape(s.num_kv_heads, -1, s.head_dim))
        self.kv.values[layer].index_copy_(1, slots, value.transpose(0, 1).reshape(s.num_kv_heads, -1, s.head_dim))
        k = key.transpose(1, 2).reshape(-1, s.num_kv_heads, s.head_dim)
        self.key_min[layer].scatter_reduce_(0, self.bound_index, k, "amin")  # (fresh blocks were reset in prepare)
        self.key_max[layer].scatter_reduce_(0, self.bound_index, k, "amax")

    def adopt_pass(self, layer, recorded, step: Step):
        self._write(layer, recorded.key(layer), recorded.value(layer))

    # -- attention -------------------------------------------------------------------------------------------------
    def attend(self, layer, query, key, value, step: Step):
        self._write(layer, key, value)
        b, s, bs = len(step.rows), self.spec, self.block_size
        if step.phase == "prefill":
            n = int(step.start[0]) + step.q_len
            slots = (self.table[0, :-(-n // bs), None] * bs + torch.arange(bs, device=self.device)).flatten()[:n]
            with self.ledger.transient("device", "activations", n * s.kv_bytes_per_token // s.num_layers,
                                       f"quest prefill gather, layer {layer}"):
                k, v = (c[layer][:, slots][None] for c in (self.kv.keys, self.kv.values))
                return prefill_attention(query, k, v, int(step.start[0]), step.prefill_mode, self.scale, self.ledger,
                                         layer)
        self.bytes_read_full += step.tokens_seen * s.num_kv_heads * 2 * s.head_dim * s.dtype_bytes  # a full read
        keys, values = self.kv.keys[layer], self.kv.values[layer]
        if layer < self.dense_layers:
            self.usage.add(layer, step.tokens_seen, step.tokens_seen, b)
            reads = DecodeReads(keys, values, self.seen, table=self.table, block_size=bs)
            return self.decode_attention(layer, query, reads)[0]
        with self.timers.section("selection"):
            table, lengths = self.choose_blocks(layer, query)
        blocks = int(self.row_blocks.sum())  # each block's min and max, per KV head, against each query head
        self.work.add("decode", select_read_bytes=blocks * s.num_kv_heads * 2 * s.head_dim * s.dtype_bytes,
                      select_flops=4 * blocks * s.num_attention_heads * s.head_dim)
        self.usage.add(layer, self.attended, step.tokens_seen, b)  # per KV head: every head reads as many tokens
        return self.decode_attention(layer, query, DecodeReads(keys, values, lengths, table=table, block_size=bs))[0]

    def choose_blocks(self, layer: int, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's selection, as the decode kernel reads it: (block list [B, Hkv, n], tokens read [B, Hkv]).
        Where decode attention runs kvlib's C kernel (the machine's choice, kvlib.kernels.decode.kernel_for), one C
        call (kvlib.kernels.cpu_kernel.quest_select); elsewhere the PyTorch ops below, which choose the same."""
        kmin, kmax = self.key_min[layer], self.key_max[layer]
        if self.decode_kernel == "c":
            return cpu_kernel.quest_select(query, kmin, kmax, self.table, self.row_blocks, self.pages, self.seen,
                                           self.block_size, self.picks)
        return self.selected_blocks(self.select_blocks(query, self.table, kmin, kmax))

    def selected_blocks(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block list [B, Hkv, n] in position order, tokens read [B, Hkv]) of each KV head's chosen blocks: whole
        blocks, and the row's last block (always chosen, and last in order) up to the row's length."""
        width = chosen.shape[-1]
        index = torch.arange(width, device=chosen.device)
        order = torch.where(chosen, index, width + index).sort(dim=-1).values  # chosen first, in position order
        picked = chosen.sum(dim=-1).cpu()
        order = order[..., :int(picked.max())].clamp(max=width - 1)  # past a head's picks: never read
        table = self.table[:, None, :].expand(-1, chosen.shape[1], -1).gather(2, order).contiguous()
        last = self.seen - (self.row_blocks - 1) * self.block_size  # tokens in each row's last block
        return table, (picked - 1) * self.block_size + last[:, None]

    def select_blocks(self, query, table, kmin, kmax) -> torch.Tensor:
        """Boolean [B, Hkv, blocks]: per KV head the blocks whose upper bound of q.k ranks in the row's top
        pages_read, the row's last block always among them. table [B, blocks]; kmin/kmax: the
        layer's [pool blocks, Hkv, D]."""
        b, s = table.shape[0], self.spec
        lo, hi = kmin.index_select(0, table.flatten()), kmax.index_select(0, table.flatten())
        lo = lo.view(b, -1, s.num_kv_heads, s.head_dim).transpose(1, 2)  # [B, Hkv, blocks, D]
        hi = hi.view(b, -1, s.num_kv_heads, s.head_dim).transpose(1, 2)
        q = query.view(b, s.num_kv_heads, -1, s.head_dim)  # [B, Hkv, G, D]
        # sum over channels of max(q_d x max_d, q_d x min_d) is q+ . max + q- . min: two batched matmuls instead of
        # [B, Hkv, G, blocks, D] temporaries
        bound = (q.clamp(min=0) @ hi.transpose(-1, -2) + q.clamp(max=0) @ lo.transpose(-1, -2)).amax(dim=2)
        width = table.shape[1]
        index = torch.arange(width, device=self.device)
        real = index[None, :] < self.row_blocks[:, None].to(self.device)
        last = index[None, :] == (self.row_blocks[:, None] - 1).to(self.device)
        bound = bound.masked_fill(~real[:, None], float("-inf")).masked_fill(last[:, None], float("inf"))
        # best first, equal bounds in position order (the C selection's rule): position j has rank j
        top = bound.sort(dim=-1, descending=True, stable=True).indices[..., :min(int(self.pages.max()), width)]
        within = torch.arange(top.shape[-1], device=self.device) < self.pages[:, None, None].to(self.device)
        return torch.zeros_like(bound, dtype=torch.bool).scatter_(-1, top, within.expand_as(top)) & real[:, None]

    def after_pass(self, step: Step):
        with self.timers.section("block_management"):
            for row, end in step.row_ends:
                self.kv.pool.commit(self.tables[row], [], end)
            self._book()

    def fork(self, src, dst):
        self.kv.share(src, dst)
        self._book()

    def release(self, row):
        self.kv.release(row)

    def _book(self):
        kv = self.kv.kv_bytes()
        used = self.kv.pool.used * kv // self.kv.pool.num_blocks
        self.ledger.set("device", "quest block tables", kv=used, kv_reserved=kv - used, overhead=self.kv.total_bytes()
                        - kv + sum(len(t.blocks) for t in self.tables.values()) * 4)

    def finish(self):
        self.kv = self.key_min = self.key_max = None
        self.ledger.set("device", kv=0, kv_reserved=0, overhead=0)

    def stats(self):
        # what decode attention read (the work counter's count: the dense layers' every token, the sparse ones'
        # selected blocks) and the block bounds the selection scanned, against a full read of every layer
        decode = self.work.counts["decode"]
        read = decode["kv_read_bytes"] + decode["select_read_bytes"]
        return {"block_size": self.block_size, "num_blocks": self.kv.pool.num_blocks if self.kv else None,
                "peak_blocks_used": self.peak_blocks, "kv_bytes_read": read, "kv_bytes_read_full": self.bytes_read_full,
                "kv_read_share": read / self.bytes_read_full if self.bytes_read_full else None}
