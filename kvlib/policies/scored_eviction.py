"""The mechanism shared by the policies that keep, per KV head, the best-scored tokens within a budget (H2O,
StreamingLLM, SnapKV): the scoring (what to keep) lives in each policy; the kept entries and the operations that change
them (open a prompt, compact, evict one, compress, fork, release) in kvlib.policies.kept_tokens; the passes, the
allocation's counts and the booking here.

Storage: a head-major block pool (kvlib.memory.paged_kv, the one `paged` holds its cache in), with each slot's score
and original position (-1 = empty) beside its key and value. A row's slot i lies in block `table[i // block_size]`
for every layer and KV head alike. A row's prefill writes the whole new prompt into its blocks, after what it keeps
from earlier turns (reordered by position); the blocks are reserved when the prefill opens (the scheduler asks first,
pool_room), so a prompt that does not fit fails before any compute. When its last chunk is in, `select` picks per
(layer, KV head) the `keep - recent` best-scored older tokens plus the `recent` newest; they are moved, in position
order, to the row's first `keep` slots and the blocks past them go back to the pool: the budget is capacity another
request can use (continuous batching). At decode the new token takes a free slot; once a row holds more than `limits`
allows, each (layer, row, KV head) drops its lowest-scored token outside the recent window and its slot is reused by
the next one. Every byte is booked: the kept entries as `kv`, the rest of the pool as `kv_reserved`, the scores and
positions (4 + 8 bytes a slot) and the per-row counters as `overhead`.

Decode reads a row's slots in place through its block table (kvlib.kernels.decode): a new token fills the hole the
last eviction left, or the next slot, so a row's slots are its first ones and its length is all the kernel needs.

`allocation` (kvlib.policies.allocation) splits the prompt's budget unevenly across heads (`adaptive`, Ada-KV) or
layers (`pyramid`, PyramidKV), at about the same total. A head then keeps `delta` more (or fewer) entries than the
row's uniform count, fixed from its compaction on, in its own first slots; decode reads a length per (row, KV head),
and its eviction is unchanged (every head of a row is over budget when the row is). The row's blocks cover its widest
(layer, head) for every head: all are booked as `kv`, padding included (what the device holds, and what the frontier
compares). A later turn of a conversation is refused there: its prefill would attend heads of different lengths.

A subclass gives `limits` (tokens kept and protected-recent for a row) and, where it scores, the hooks: the score a new
entry starts with (`initial_scores`), the prefill attention (`prefill_attention_of`, which may score what the row holds),
and `update_scores` with each decode step's attention probabilities (`decode_scores`: it asks the kernel for them).
A subclass that declares `adopts_prefill` adopts a recorded dense prefill (kvlib.engine.prefill_record): the same
storage runs, and `prefill_statistics` adds from the record the scores its prefill_attention_of would have added.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlib.errors import UserError
from kvlib.kernels.attention import prefill_attention
from kvlib.kernels.decode import DecodeReads
from kvlib.memory.paged_kv import check_pool_settings
from kvlib.policies.allocation import (
    ALLOCATIONS,
    adaptive_counts,
    pyramid_counts,
    select_heavy_recent,
    select_per_head,
    widest_count,
)
from kvlib.policies.base import BudgetedPolicy, Step
from kvlib.policies.kept_tokens import KeptTokens


@dataclass
class ScoredEvictionPolicy(BudgetedPolicy):
    """Keep the top tokens per KV head given scores and a budget; evicted entries are freed for good."""

    decode_scores: ClassVar[bool] = False  # update_scores needs each decode step's attention probabilities
    keeps = "a budget of entries per KV head"
    allocations: ClassVar[tuple[str, ...]] = ALLOCATIONS  # the allocations its scoring gives a meaning to
    # a compressed row's limits count from the compression (its prompt_of moves there); False: from its last prefill
    compress_restarts_limits: ClassVar[bool] = True

    block_size: int = 16
    num_blocks: int | None = None  # None: enough for the batch (or, when serving, what the device capacity leaves)
    allocation: str = "uniform"  # how a prompt's budget is split across layers and heads (kvlib.policies.allocation)
    floor_alpha: float = 0.2  # adaptive: the share of the uniform count every head keeps at least
    pyramid_beta: float = 20.0  # pyramid: the last layer keeps 1/beta of the mean

    def __post_init__(self):
        super().__post_init__()
        check_pool_settings(self.block_size, self.num_blocks)
        if self.allocation not in self.allocations:
            raise UserError(f"allocation must be one of {list(self.allocations)} for policy {self.name!r}, got "
                            f"{self.allocation!r}")
        if not 0 <= self.floor_alpha <= 1:
            raise UserError(f"floor_alpha must be in [0, 1], got {self.floor_alpha}")
        if self.pyramid_beta < 1:
            raise UserError(f"pyramid_beta must be >= 1, got {self.pyramid_beta}")
        self.tokens: KeptTokens | None = None  # the rows' kept entries, from start() to finish()

    def settings(self) -> dict:
        """Without the allocation's settings at `uniform`, where they do nothing: a study point's key hashes its
        settings, and the uniform points' keys (their results files) stay those they had before allocations."""
        settings = super().settings()
        if self.allocation == "uniform":
            for name in ("allocation", "floor_alpha", "pyramid_beta"):
                settings.pop(name)
        return settings

    # -- what a subclass decides ------------------------------------------------------------------------------------
    def limits(self, seen: int, prompt: int) -> tuple[int, int]:
        """(tokens a row keeps per KV head, of which the most recent) once it has seen `seen` tokens, `prompt` of
        them by the end of its last prefill."""
        raise NotImplementedError

    def initial_scores(self, positions: torch.Tensor) -> torch.Tensor | float:
        """The score an entry starts with, given its original position."""
        return 0.0

    def prefill_attention_of(self, layer: int, query, keys, values, scores, begin: int, filled: int, step: Step):
        """Attention of a prompt chunk over the row's first `filled` + T entries (keys/values [Hkv, end, D]); may
        add to `scores` [Hkv, end] (written back to the row's slots). begin: the position of the chunk's first
        token."""
        return prefill_attention(query, keys[None], values[None], filled, step.prefill_mode, self.scale,
                                 self.ledger, layer)

    def prefill_statistics(self, layer: int, recorded, keys, scores, step: Step) -> None:
        """Adopting a recorded dense prefill (KVPolicy.adopt_pass): add to `scores` [Hkv, end] what
        prefill_attention_of adds, from the record (recorded: kvlib.models.passes.RecordedPass) and the row's
        keys [Hkv, end, D]. Scoring by position alone (the default initial_scores) adds nothing."""

    def decode_reads(self, layer: int, query, rows, lengths) -> tuple[torch.Tensor, DecodeReads]:
        """(query, what each row reads) in a decode step: the rows' first `lengths` slots, in place through their
        block tables. StreamingLLM's `cache` positions re-rotate a copy of them."""
        return query, DecodeReads(self.kv.keys[layer], self.kv.values[layer], lengths, table=self.tokens.table,
                                  block_size=self.block_size, probs=self.decode_scores)

    def update_scores(self, layer: int, rows: torch.Tensor, probs: torch.Tensor) -> None:
        """After a decode step's attention (where decode_scores): probs [B, Hkv, L], each slot's attention summed over
        the KV head's query group, zeros past a row's length (self.tokens.add_scores adds them to the slots)."""

    def select(self, scores: torch.Tensor, heavy: int, recent: int) -> torch.Tensor:
        """Per head, the last `recent` entries and the `heavy` best-scored earlier ones, sorted. scores: [..., n]."""
        return select_heavy_recent(scores, heavy, recent)

    def extra_overhead(self) -> int:
        """Bytes of policy-specific state held between passes (booked as overhead)."""
        return 0

    # -- what a subclass reads ----------------------------------------------------------------------------------------
    @property
    def kv(self):
        return self.tokens.kv if self.tokens is not None else None

    @property
    def scores(self) -> torch.Tensor:
        return self.tokens.scores  # [L, Hkv, slots]

    @property
    def positions(self) -> torch.Tensor:
        return self.tokens.positions

    @property
    def kept(self) -> torch.Tensor:
        return self.tokens.kept  # [B] entries a row keeps per head at its uniform count

    @property
    def delta(self) -> torch.Tensor:
        return self.tokens.delta  # [L, B, Hkv] what a head keeps beyond it (an uneven allocation)

    @property
    def read_slots(self) -> torch.Tensor:  # [B, W x block_size] a decode step's rows' slots
        return self.tokens.read_slots

    def prompt_positions(self, layer: int, end: int) -> torch.Tensor:
        """[Hkv, end] the original positions of what the prefilling row holds (in a prefill_attention_of)."""
        return self._row_part(self.positions[layer], end)

    def kept_positions(self, layer: int, row: int) -> list[set[int]]:
        """Original token positions each KV head of a row keeps (for tests and the book's overlap figures)."""
        return self.tokens.kept_positions(layer, row)

    # -- lifecycle --------------------------------------------------------------------------------------------------
    def start(self, batch_size, prompt_lens, max_new_tokens):
        if self.budget_tokens is not None and self.budget_tokens > min(prompt_lens):
            raise UserError(f"budget_tokens={self.budget_tokens} exceeds the shortest prompt ({min(prompt_lens)} tokens)")
        s, bs = self.spec, self.block_size
        block_bytes = KeptTokens.block_bytes(s, bs)
        # the static schedule's peak: every row at its largest kept set (+1: the new token is stored before the
        # step's eviction frees a slot), and the longest prompt in full while it is prefilled
        kept_blocks = sum(-(-(self._widest(n, max_new_tokens) + 1) // bs) for n in prompt_lens)
        needed = kept_blocks + max(-(-n // bs) for n in prompt_lens)
        blocks = self.num_blocks or self.pool_blocks(needed, block_bytes)
        self.tokens = None  # until the pool fits the device
        self.ledger.add("device", "kv_reserved", s.kv_bytes(blocks * bs), where=f"{self.name} KV pool")
        self.ledger.add("device", "overhead", blocks * (block_bytes - s.kv_bytes(bs)),
                        where=f"{self.name} scores and positions")
        self.tokens = KeptTokens.allocate(s, self.device, blocks, bs, batch_size, self.allocation != "uniform")
        self.peak_blocks = 0

    def attend(self, layer, query, key, value, step: Step):
        if step.phase == "prefill":
            return self._prefill(layer, query, key, value, step)
        return self._decode(layer, query, key, value, step)

    def prepare(self, step: Step):
        if step.phase == "prefill":
            row = int(step.rows[0])
            if row not in self.tokens.filling:
                if int(self.kept[row]) and self.tokens.uneven(row):
                    raise UserError(f"allocation {self.allocation!r} compacts one prompt a row: its heads hold "
                                    "different counts, which a later turn's prefill cannot attend (use allocation "
                                    "'uniform')")
                with self.timers.section("eviction"):
                    self.tokens.open_prompt(row, int(step.end[0]) - int(step.start[0]))
            end = self.tokens.filling[row] + step.q_len  # the row's slots once this chunk is in
            self.pass_slots, self.pass_run = self.kv.slots(row, 0, end), self.kv.one_run(row, end)
        else:
            with self.timers.section("block_management"):
                self.tokens.prepare_decode(step.rows)
        self.peak_blocks = max(self.peak_blocks, self.kv.pool.used)

    def pool_room(self, step: Step):
        with self.timers.section("block_management"):
            return self.tokens.room(step)

    def _row_part(self, array: torch.Tensor, end: int) -> torch.Tensor:
        """A layer's [Hkv, slots, ...] array over the prefilling row's first `end` slots: a view where its blocks are
        one run, else a copy."""
        if self.pass_run is not None:
            return array[:, self.pass_run:self.pass_run + end]
        return array.index_select(1, self.pass_slots[:end])

    def adopt_pass(self, layer, recorded, step: Step):
        self._prefill(layer, None, recorded.key(layer), recorded.value(layer), step, recorded)

    def _prefill(self, layer, query, key, value, step, recorded=None):
        """Store a prefill pass's new entries, then attend over the row (prefill_attention_of, scores included); or,
        adopting a recorded prefill (recorded given), take the scores from it (prefill_statistics) instead."""
        row, begin, t = int(step.rows[0]), int(step.start[0]), step.q_len
        filled = self.tokens.filling[row]
        end = filled + t
        positions = torch.arange(begin, begin + t, device=self.device)
        self.tokens.store_prompt(layer, self.pass_slots[filled:end], key[0], value[0], positions,
                                 self._initial(positions))
        copied = 0 if self.pass_run is not None else end * self.kv.slot_bytes // self.spec.num_layers
        with self.ledger.transient("device", "activations", copied, f"{self.name} prefill gather, layer {layer}"):
            keys, values = (self._row_part(c[layer], end) for c in (self.kv.keys, self.kv.values))
            scores = self._row_part(self.scores[layer], end)
            if recorded is None:
                out = self.prefill_attention_of(layer, query, keys, values, scores, begin, filled, step)
            else:
                out = self.prefill_statistics(layer, recorded, keys, scores, step)
        if self.pass_run is None:  # scores added to a copy go back to the slots
            self.scores[layer].index_copy_(1, self.pass_slots[:end], scores)
        return out

    def _initial(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(self.initial_scores(positions), dtype=self.scores.dtype, device=self.device)

    def _compact(self, row: int):
        """End of a row's prefill: keep what `select` picks, in position order, per head; free the blocks past it."""
        filled, seen = self.tokens.filling[row], int(self.tokens.seen[row])
        keep, recent = self.limits(seen, seen)
        keep = min(keep, filled)  # a conversation's row holds less than it has seen: earlier turns were evicted
        recent = min(recent, keep)
        scores = self.tokens.prompt_scores(row)
        if self.allocation == "uniform":
            idx = self.select(scores, keep - recent, recent)  # [L, Hkv, keep]
            heavy = torch.full(self.delta.shape[::2], keep - recent, dtype=torch.long)
        else:
            heavy = self.heavy_counts(scores[..., :filled - recent], keep - recent)
            idx = select_per_head(scores, heavy, recent)  # [L, Hkv, widest]: each head's own count, then padding
        self.tokens.compact(row, idx, heavy + recent, keep)

    def _widest(self, prompt: int, max_new_tokens: int) -> int:
        """The most slots a row of this prompt uses: its largest kept set, and under an uneven allocation what its
        widest head keeps beyond the uniform count (fixed while decode evicts)."""
        keep = self.limits(prompt + max_new_tokens, prompt)[0]
        if self.allocation == "uniform":
            return keep
        kept, recent = self.limits(prompt, prompt)
        heavy, s = min(kept, prompt) - min(recent, kept), self.spec
        return keep + widest_count(self.allocation, heavy, prompt - min(recent, kept), s.num_kv_heads,
                                   s.num_layers, self.floor_alpha) - heavy

    def heavy_counts(self, scores: torch.Tensor, heavy: int) -> torch.Tensor:
        """[L, Hkv] the older tokens each head keeps under the allocation (scores [L, Hkv, n] of the older ones)."""
        if self.allocation == "adaptive":
            return adaptive_counts(scores, heavy, self.floor_alpha).cpu()
        layers, heads, n = scores.shape
        return pyramid_counts(layers, heads, heavy, n, self.pyramid_beta)

    def compress(self, row: int, share: float) -> tuple[int, int]:
        """Compact a row that is decoding to `share` of the entries each of its heads holds, chosen as its prompt's
        were (`select` on the scores so far: H2O's accumulated attention, SnapKV's votes), and give the blocks past
        them back to the pool (kvlib.engine.scheduler's `compress` schedule, which does this where vLLM would
        preempt). From then on the row keeps what its limits allow counting from here (where
        `compress_restarts_limits`): at budget 1.0, everything new. Returns (entries a head held, entries it keeps)."""
        if row in self.tokens.filling:
            raise ValueError(f"row {row} is being prefilled; only a decoding row can be compressed")
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        if self.tokens.uneven(row):
            raise UserError(f"allocation {self.allocation!r}: a row whose heads hold different counts cannot be "
                            "compressed again")
        held = int(self.kept[row])
        keep = max(1, round(share * held))
        recent = min(self.limits(keep, keep)[1], keep)
        with self.timers.section("eviction"):
            self.tokens.compress(row, keep, lambda scores: self.select(scores, keep - recent, recent),
                                 self.compress_restarts_limits)
            self._book()
        return held, keep

    def fork(self, src, dst):
        if src in self.tokens.filling:
            raise UserError(f"row {src} is in the middle of a prefill and cannot be forked")
        self.tokens.fork(src, dst)
        self._book()

    def release(self, row):
        self.tokens.release(row)

    # -- decode -----------------------------------------------------------------------------------------------------
    def _decode(self, layer, query, key, value, step):
        rows, tokens = step.rows, self.tokens
        if layer == 0:  # what every layer's heads attend this step: the kept tokens and the new one
            self.attended = int(self.kept[rows].sum()) + len(rows)
        attended = self.attended
        lengths = tokens.lengths
        if tokens.head_lengths is not None:
            lengths = tokens.head_lengths[layer]
            attended += int(self.delta[layer, rows].sum()) / self.spec.num_kv_heads
        new_pos = step.start[:, None].to(self.device).expand(-1, self.spec.num_kv_heads)
        tokens.append(layer, key[:, :, 0], value[:, :, 0], new_pos, self._initial(new_pos))
        q, reads = self.decode_reads(layer, query, rows, lengths)
        copied = 0 if reads.keys.untyped_storage().data_ptr() == self.kv.keys.untyped_storage().data_ptr() else \
            reads.keys.nbytes + reads.values.nbytes
        with self.ledger.transient("device", "activations", copied, f"{self.name} decode rows, layer {layer}"):
            out, probs = self.decode_attention(layer, q, reads)
        if probs is not None:
            self.update_scores(layer, rows, probs)
        self.usage.add(layer, attended, step.tokens_seen, len(rows))
        return out

    def after_pass(self, step: Step):
        with self.timers.section("eviction"):
            if step.phase == "prefill":
                row = int(step.rows[0])
                self.tokens.seen[row] = int(step.start[0]) + step.q_len
                self.tokens.filling[row] += step.q_len
                if step.last_chunk:
                    self._compact(row)
            else:
                self.tokens.evict_one(step.rows, self.limits)
                self.tokens.end_decode()
            self._book()

    def _book(self):
        kv, pool_kv = self.tokens.held_slots() * self.spec.kv_bytes_per_token, self.kv.kv_bytes()
        self.ledger.set("device", f"{self.name} cache", kv=kv, kv_reserved=pool_kv - kv,
                        overhead=self.kv.total_bytes() - pool_kv + self.tokens.counter_bytes() + self.extra_overhead())

    def finish(self):
        self.tokens = None
        self.ledger.set("device", kv=0, kv_reserved=0, overhead=0)

    def stats(self) -> dict:
        return {"block_size": self.block_size, "num_blocks": self.kv.pool.num_blocks if self.kv else None,
                "peak_blocks_used": self.peak_blocks, "allocation": self.allocation}
