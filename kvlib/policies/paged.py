"""The memory-management paradigm (vLLM's PagedAttention) inside kvlib's engine.

Every key and value stays on the device, in a pool of fixed-size blocks preallocated up front; each row has a block
table. Full prompt blocks are shared between rows with the same prefix (kvlib.memory.block_pool), shared blocks are copied
before they are written, and memory grows a block at a time, so rows of different lengths waste at most one partly
filled block each instead of a reservation for the longest row.

Decode attention reads the pool in place, each row over its own tokens. On a CPU in fp32 that is the C kernel every
policy decodes with (kvlib.kernels.decode), following each row's block table. Elsewhere (a GPU, no C compiler) it is
PyTorch's kernels (kvlib.kernels.attention.paged_decode_attention), not the shared PyTorch path, which would gather the
blocks into a padded copy each layer: the pool (head-major: each KV head's slots are one stretch) is cut into
aligned spans of SPAN_TOKENS slots, and each run of consecutive spans the batch holds tokens in is attended in one
call (the pool's last, shorter span in one more), each span by the queries of the rows holding tokens in it, masked to
each row's own slots. The few tokens in spans read by more than MAX_READERS rows (the blocks rows grew by during
decode, handed out to one row after another, sit side by side) are gathered for the whole batch into one small tensor
and attended in one masked call; the parts are merged by their log-sum-exp. A lone row in one run is one SDPA call.
Prefill reads a row in place when its blocks are one run (a fresh row's usually are) and gathers it otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.errors import UserError
from kvlib.kernels.attention import PagedLayout, SpanGroup, paged_decode_attention, prefill_attention
from kvlib.kernels.decode import DecodeReads
from kvlib.memory.block_pool import BlockPool, BlockTable
from kvlib.policies.base import KVPolicy, Step
from kvlib.policies.registry import register

# Decode attention's unit of work, in pool slots (a multiple of any block size up to it). One call over all spans in
# place, against one flash call per row over its own run, and SDPA over a copy padded to the longest row (`full`),
# SmolLM2's 30 layers at batch 16 over rows of 128-1,024 tokens, best of 5: 1.16-1.19 vs 1.46-1.49 vs 1.31-1.34 ms a
# layer; spans of 128 slots 1.30, of 64 1.56 (smaller spans are more, smaller work items for the flash kernel).
SPAN_TOKENS = 256
# Every span of a call gets R x G queries, R the most rows any of its spans serves (a reader slot no row fills is
# masked). Rows of a batch meet in the span where one row's blocks end and the next row's begin (2 readers); a row
# shorter than a span can lie inside one with its neighbours on both sides (3 or 4). Consecutive spans read by up to
# MAX_READERS rows are one call: padding the batch's 2-reader spans to the widest one's readers cost less than a call
# of its own for each wider span (batch 8: 0.94-1.32 against 1.13-1.43 ms a layer; batch 16 the same within 3 %). A
# span read by more rows (the blocks rows grow by during decode are handed out one row after another, side by side) is
# gathered into the tail, except for a row holding at least a quarter of it (where its prompt's last blocks meet the
# batch's decode blocks), which still reads it in place. The tail is padded to its longest row: gathering the 172-token
# row of the benchmark's batch of 8 would copy 172 tokens for every row, in every layer.
MAX_READERS = 4


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


def decode_layout(tables: list[list[int]], lengths: list[int], block_size: int, pool_blocks: int, group: int,
                  dtype: torch.dtype, device) -> PagedLayout:
    """Where a decode step's rows lie in a pool of pool_blocks blocks: the spans read in place, in groups of
    consecutive spans, and the other tokens' slots gathered (the tail). group: query heads per KV head."""
    row_runs = block_runs(tables[0], lengths[0], block_size)
    if len(tables) == 1 and len(row_runs) == 1:  # a lone row in one run: one call over the run, nothing to merge
        (first, count), = row_runs
        return PagedLayout([SpanGroup(first, count, torch.zeros(1, 1, dtype=torch.long, device=device), None)],
                           None, None, torch.zeros(1, dtype=torch.long, device=device), lone_run=True)
    per_span = max(SPAN_TOKENS, block_size) // block_size
    holders: dict[int, dict[int, list[tuple[int, int]]]] = {}  # span -> row -> [(block within span, tokens)]
    for row, (blocks, n) in enumerate(zip(tables, lengths)):
        for i in range(-(-n // block_size)):
            block = blocks[i]
            holders.setdefault(block // per_span, {}).setdefault(row, []).append(
                (block % per_span, min(block_size, n - i * block_size)))
    readers_of: dict[int, dict[int, list[tuple[int, int]]]] = {}  # span -> the rows that read it in place
    tails: list[list[int]] = [[] for _ in tables]
    for j, rows in holders.items():
        if len(rows) > MAX_READERS:
            kept = {row: held for row, held in rows.items() if sum(c for _, c in held) * 4 >= per_span * block_size}
            for row in rows.keys() - kept.keys():
                tails[row] += [(j * per_span + pos) * block_size + t for pos, count in rows[row] for t in range(count)]
            rows = kept
        if rows:
            readers_of[j] = rows

    def blocks_in(j):  # the pool's last span may be short
        return min(per_span, pool_blocks - j * per_span)

    def joins(j, run):  # span j extends a run of spans into one call
        return run[-1] == j - 1 and blocks_in(j) == per_span

    span_runs: list[list[int]] = []
    for j in sorted(readers_of):
        if span_runs and joins(j, span_runs[-1]):
            span_runs[-1].append(j)
        else:
            span_runs.append([j])
    batch, groups, segments = len(tables), [], []
    for run in span_runs:
        width, span_blocks = max(len(readers_of[j]) for j in run), blocks_in(run[0])
        readers = [list(readers_of[j]) + [batch] * (width - len(readers_of[j])) for j in run]
        tokens = [[[0] * span_blocks for _ in range(width)] for _ in run]  # per reader, its tokens in each block
        for i, j in enumerate(run):
            for k, held in enumerate(readers_of[j].values()):
                for pos, count in held:
                    tokens[i][k][pos] = count
        readers, tokens = torch.tensor(readers), torch.tensor(tokens)
        visible = (torch.arange(block_size) < tokens[..., None]).view(len(run), width, 1, -1)
        visible = visible.expand(-1, -1, group, -1).reshape(len(run), 1, width * group, -1)
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
        groups.append(SpanGroup(run[0] * per_span * block_size, span_blocks * block_size, readers.to(device),
                                mask.to(device)))
        segments.append(readers.flatten())
    width = max(map(len, tails))
    tail_index = tail_mask = None
    if width:
        tail_index = torch.tensor([t + [0] * (width - len(t)) for t in tails]).to(device)
        counts = torch.tensor([len(t) for t in tails])
        visible = torch.arange(width)[None, :] < counts[:, None]
        tail_mask = torch.zeros(batch, 1, 1, width, dtype=dtype).masked_fill_(~visible[:, None, None], float("-inf"))
        tail_mask = tail_mask.to(device)
        # a row with no tail tokens has no tail result (attention_with_lse: its lse would read 0, not -inf)
        segments.append(torch.where(counts > 0, torch.arange(batch), batch))
    return PagedLayout(groups, tail_index, tail_mask, torch.cat(segments).to(device))


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
        self.layout = None  # a decode step's plan of PyTorch's spans
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
            if self.decode_kernel == "torch":  # PyTorch's kernels read the pool in place through spans (below)
                s = self.spec
                self.layout = decode_layout(tables, self.read.tolist(), bs, self.pool.num_blocks,
                                            s.num_attention_heads // s.num_kv_heads, s.dtype, self.device)
                self.workspace = self.layout.workspace_bytes(s.num_kv_heads * s.head_dim * s.dtype_bytes,
                                                             s.num_attention_heads * s.head_dim * s.dtype_bytes)
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
            if self.decode_kernel == "c":
                pools = (c[layer] for c in self.flat_pools)
                return self.decode_attention(layer, query, DecodeReads(*pools, self.read, table=self.table,
                                                                       block_size=self.block_size))[0]
            with self.ledger.transient("device", "activations", self.workspace,
                                       f"paged decode workspace, layer {layer}"):
                return paged_decode_attention(query, *self.flat_pools, self.layout, self.scale, layer)
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
            self.layout = None  # a step's plan, booked with its workspace: not held between steps
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
