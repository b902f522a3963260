"""The mechanism shared by the policies that keep, per KV head, the best-scored tokens within a budget (H2O,
StreamingLLM, SnapKV): the scoring (what to keep) lives in each policy, the storage, compaction and freeing here.

Storage: a head-major block pool (kvlib.memory.paged_kv, the one `paged` holds its cache in), with each slot's score
and original position (-1 = empty) beside its key and value. A row's slot i lies in block `table[i // block_size]`
for every layer and KV head alike. A row's prefill writes the whole new prompt into its blocks, after what it keeps
from earlier turns (reordered by position); the blocks are reserved when the prefill opens, so a prompt that does not
fit fails before any compute. When its last chunk is in, `select` picks per (layer, KV head) the `keep - recent`
best-scored older tokens plus the `recent` newest; they are moved, in position order, to the row's first `keep` slots
and the blocks past them go back to the pool: the budget is capacity another request can use (kvlib.engine.scheduler,
continuous batching). At decode the new token takes a free slot; once a row holds more than `limits` allows, each
(layer, row, KV head) drops its lowest-scored token outside the recent window and its slot is reused by the next one.
Every byte is booked: the kept entries as `kv`, the rest of the pool as `kv_reserved`, the scores and positions (4 + 8
bytes a slot) and the per-row counters as `overhead`.

Decode reads each row's slots in place through its block table, with the decode attention every policy shares
(kvlib.kernels.decode): the slots a row holds are always its first ones (a new token fills the hole the last eviction
left, or the next slot), so a row's length is all the kernel needs, the same for each of its KV heads.

`allocation` (kvlib.policies.allocation) splits the prompt's budget unevenly across heads (`adaptive`, Ada-KV) or
layers (`pyramid`, PyramidKV), at about the same total (each rounds its own way). A head then keeps `delta` more (or fewer) entries than the row's
uniform count, fixed from its compaction on; the row's blocks cover its widest head, every head keeps its entries in
its own first slots, and decode reads a length per (row, KV head) (the kernel's per-head lengths). Since every head of a
row is over budget when the row is, decode eviction is unchanged. The blocks are the widest head's, so an uneven
allocation holds its entries in the slots of its widest (layer, head) for every head: all of them are booked as `kv`,
padding included, since that is what the device holds for the row (and what the frontier compares). A later turn of a
conversation under an uneven allocation is refused: its prefill would attend heads of different lengths.

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
from kvlib.memory.paged_kv import PagedKV, PerSlot, check_pool_settings
from kvlib.policies.allocation import ALLOCATIONS, adaptive_counts, pyramid_counts, select_per_head, widest_count
from kvlib.policies.base import BudgetedPolicy, Step

SLOT_ARRAYS = {"scores": PerSlot(torch.float32, 0.0), "positions": PerSlot(torch.long, -1)}


@dataclass
class ScoredEvictionPolicy(BudgetedPolicy):
    """Keep the top tokens per KV head given scores and a budget; evicted entries are freed for good."""

    decode_scores: ClassVar[bool] = False  # update_scores needs each decode step's attention probabilities
    keeps = "a budget of entries per KV head"
    allocations: ClassVar[tuple[str, ...]] = ALLOCATIONS  # the allocations its scoring gives a meaning to

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
        prefill_attention_of adds, from the record (recorded: kvlib.engine.prefill_record.RecordedPass) and the row's
        keys [Hkv, end, D]. Scoring by position alone (the default initial_scores) adds nothing."""

    def decode_reads(self, layer: int, query, rows, lengths) -> tuple[torch.Tensor, DecodeReads]:
        """(query, what each row reads) in a decode step: the rows' first `lengths` slots, in place through their
        block tables. StreamingLLM's `cache` positions re-rotate a copy of them."""
        return query, DecodeReads(self.kv.keys[layer], self.kv.values[layer], lengths, table=self.table,
                                  block_size=self.block_size, probs=self.decode_scores)

    def update_scores(self, layer: int, rows: torch.Tensor, probs: torch.Tensor) -> None:
        """After a decode step's attention (where decode_scores): probs [B, Hkv, L], each slot's attention summed over
        the KV head's query group, zeros past a row's length (add_scores adds them to the slots)."""

    def select(self, scores: torch.Tensor, heavy: int, recent: int) -> torch.Tensor:
        """Per head, the last `recent` entries and the `heavy` best-scored earlier ones, sorted. scores: [..., n]."""
        return select_heavy_recent(scores, heavy, recent)

    def extra_overhead(self) -> int:
        """Bytes of policy-specific state held between passes (booked as overhead)."""
        return 0

    # -- what a subclass reads ----------------------------------------------------------------------------------------
    @property
    def scores(self) -> torch.Tensor:
        return self.kv.per_slot["scores"]  # [L, Hkv, slots]

    @property
    def positions(self) -> torch.Tensor:
        return self.kv.per_slot["positions"]

    def add_scores(self, layer: int, probs: torch.Tensor) -> None:
        """Add a decode step's probabilities [B, Hkv, L] (row b = the step's row b) to the slots they were read from."""
        probs = probs[..., :self.read_slots.shape[1]]  # (the PyTorch path on CUDA pads past every row's length)
        slots = self.read_slots[:, None, :probs.shape[-1]].expand(-1, probs.shape[1], -1)
        heads = torch.arange(probs.shape[1], device=self.device)[None, :, None].expand_as(slots)
        # accumulate: padded table entries all point at block 0, and their zeros must not overwrite a real sum there
        self.scores[layer].index_put_((heads, slots), probs.to(self.scores.dtype), accumulate=True)

    def prompt_positions(self, layer: int, end: int) -> torch.Tensor:
        """[Hkv, end] the original positions of what the prefilling row holds (in a prefill_attention_of)."""
        return self._row_part(self.positions[layer], end)

    # -- lifecycle --------------------------------------------------------------------------------------------------
    def start(self, batch_size, prompt_lens, max_new_tokens):
        if self.budget_tokens is not None and self.budget_tokens > min(prompt_lens):
            raise UserError(f"budget_tokens={self.budget_tokens} exceeds the shortest prompt "
                            f"({min(prompt_lens)} tokens)")
        s, bs = self.spec, self.block_size
        # the static schedule's peak: every row at its largest kept set (+1: the new token is stored before the
        # step's eviction frees a slot), and the longest prompt in full while it is prefilled
        kept_blocks = sum(-(-(self._widest(n, max_new_tokens) + 1) // bs) for n in prompt_lens)
        needed = kept_blocks + max(-(-n // bs) for n in prompt_lens)
        blocks = self.num_blocks or self.pool_blocks(needed, PagedKV.block_bytes(s, bs, SLOT_ARRAYS))
        self.kv = None  # until the pool fits the device
        self.ledger.add("device", "kv_reserved", s.kv_bytes(blocks * bs), where=f"{self.name} KV pool")
        self.ledger.add("device", "overhead", blocks * (PagedKV.block_bytes(s, bs, SLOT_ARRAYS) - s.kv_bytes(bs)),
                        where=f"{self.name} scores and positions")
        self.kv = PagedKV.allocate(s, self.device, blocks, bs, SLOT_ARRAYS)
        self.kept = torch.zeros(batch_size, dtype=torch.long)  # tokens a row keeps (per head, every layer)
        self.region = torch.zeros(batch_size, dtype=torch.long)  # slots a row has used, a hole included
        self.seen = torch.zeros(batch_size, dtype=torch.long)  # tokens the row has processed
        self.write_slot = torch.zeros((s.num_layers, batch_size, s.num_kv_heads), dtype=torch.long)  # where next
        self.prompt_of = torch.zeros(batch_size, dtype=torch.long)  # tokens seen when the row's last prefill ended
        # what each (layer, row, KV head) keeps beyond the row's uniform count (`kept`), set when the prompt is
        # compacted under an allocation other than uniform; it sums to about zero over a row's heads and layers (Ada-KV's
        # formula rounds head by head), and it stays fixed while decode evicts (each head evicts when the row does)
        self.delta = torch.zeros((s.num_layers, batch_size, s.num_kv_heads), dtype=torch.long)
        self.head_lengths: torch.Tensor | None = None  # [L, B, Hkv] a decode step's reads, where delta is used
        self.filling: dict[int, int] = {}  # a prefilling row: the entries its slots hold so far
        self.peak_blocks = 0

    def attend(self, layer, query, key, value, step: Step):
        if step.phase == "prefill":
            return self._prefill(layer, query, key, value, step)
        return self._decode(layer, query, key, value, step)

    def prepare(self, step: Step):
        if step.phase == "prefill":
            row = int(step.rows[0])
            if row not in self.filling:
                with self.timers.section("eviction"):
                    self._open_prompt(row, int(step.end[0]) - int(step.start[0]))
            filled = self.filling[row]
            self.pass_slots = self.kv.slots(row, 0, filled + step.q_len)  # the row's slots once this chunk is in
            self.pass_run = self.kv.one_run(row, filled + step.q_len)
        else:
            with self.timers.section("block_management"):
                self._prepare_decode(step.rows)
        self.peak_blocks = max(self.peak_blocks, self.kv.pool.used)

    def _open_prompt(self, row: int, new_tokens: int):
        """A row's prefill begins: room for what it keeps (moved to its first slots, in position order) plus the
        whole new prompt."""
        kept, used = int(self.kept[row]), int(self.region[row])
        if kept and bool(self.delta[:, row].any()):
            raise UserError(f"allocation {self.allocation!r} compacts one prompt a row: its heads hold different "
                            "counts, which a later turn's prefill cannot attend (use allocation 'uniform')")
        self.kv.reserve(row, max(used, kept + new_tokens))
        if kept:
            slots = self.kv.slots(row, 0, used)
            pos = self.positions[:, :, slots]  # [L, Hkv, used]
            order = pos.masked_fill(pos < 0, torch.iinfo(pos.dtype).max).argsort(dim=-1)[..., :kept]
            self._move(slots[order], slots[:kept])
            self.kept[row] = 0  # the entries now count as the prompt's until the row is compacted again
        self.filling[row] = kept

    def _move(self, src: torch.Tensor, dst: torch.Tensor):
        """Every per-slot array: slots src [L, Hkv, n] (flat, per layer and head) to slots dst [n] (the same for every
        layer and head); gathered first, so the two may overlap."""
        d = self.spec.head_dim
        for cache in (self.kv.keys, self.kv.values):
            cache[:, :, dst] = cache.gather(2, src[..., None].expand(-1, -1, -1, d))
        for array in self.kv.per_slot.values():
            array[:, :, dst] = array.gather(2, src)

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
        filled = self.filling[row]
        end = filled + t
        new = self.pass_slots[filled:end]
        positions = torch.arange(begin, begin + t, device=self.device)
        self.kv.keys[layer].index_copy_(1, new, key[0])
        self.kv.values[layer].index_copy_(1, new, value[0])
        self.positions[layer][:, new] = positions
        self.scores[layer][:, new] = torch.as_tensor(self.initial_scores(positions), dtype=self.scores.dtype,
                                                     device=self.device)
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

    def _compact(self, row: int):
        """End of a row's prefill: keep what `select` picks, in position order, per head; free the blocks past it."""
        filled = self.filling.pop(row)
        seen = int(self.seen[row])
        self.prompt_of[row] = seen
        keep, recent = self.limits(seen, seen)
        keep = min(keep, filled)  # a conversation's row holds less than it has seen: earlier turns were evicted
        recent = min(recent, keep)
        slots = self.kv.slots(row, 0, filled)
        scores = self.scores[:, :, slots]
        if self.allocation == "uniform":
            idx = self.select(scores, keep - recent, recent)  # [L, Hkv, keep]
            heavy = torch.full(self.delta.shape[::2], keep - recent, dtype=torch.long)
        else:
            heavy = self.heavy_counts(scores[..., :filled - recent], keep - recent)
            idx = select_per_head(scores, heavy, recent)  # [L, Hkv, widest]: each head's own count, then padding
        width = idx.shape[-1]
        self._move(slots[idx], slots[:width])
        self.kv.truncate(row, width)
        if self.allocation != "uniform":  # a narrower head's slots past its count hold nothing, to its blocks' end
            held = self.kv.slots(row, 0, self._capacity(row))
            beyond = torch.arange(len(held))[None, None, :] >= (heavy + recent)[..., None]
            self.positions[:, :, held] = self.positions[:, :, held].masked_fill(beyond.to(self.device), -1)
        self.kept[row], self.region[row] = keep, width
        self.delta[:, row] = heavy - (keep - recent)
        self.write_slot[:, row] = keep + self.delta[:, row]

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

    def _capacity(self, row: int) -> int:
        return len(self.kv.table(row).blocks) * self.block_size

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
        preempt). From then on the row keeps what its limits allow counting from here: at budget 1.0, everything new.
        Returns (entries a head held, entries it keeps)."""
        if row in self.filling:
            raise ValueError(f"row {row} is being prefilled; only a decoding row can be compressed")
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        if bool(self.delta[:, row].any()):
            raise UserError(f"allocation {self.allocation!r}: a row whose heads hold different counts cannot be "
                            "compressed again")
        held = int(self.kept[row])
        keep = max(1, round(share * held))
        recent = min(self.limits(keep, keep)[1], keep)
        with self.timers.section("eviction"):
            slots = self.kv.slots(row, 0, int(self.region[row]))
            pos = self.positions[:, :, slots]
            order = pos.masked_fill(pos < 0, torch.iinfo(pos.dtype).max).argsort(dim=-1)[..., :held]  # by position
            idx = order.gather(-1, self.select(self.scores[:, :, slots].gather(-1, order), keep - recent, recent))
            self._move(slots[idx], slots[:keep])
            self.kv.truncate(row, keep)
            self.kept[row] = self.region[row] = keep
            self.write_slot[:, row] = keep
            self.prompt_of[row] = self.seen[row]
            self._book()
        return held, keep

    def fork(self, src, dst):
        if src in self.filling:
            raise UserError(f"row {src} is in the middle of a prefill and cannot be forked")
        used = int(self.region[src])
        self.release(dst)
        self.kv.reserve(dst, used)  # a copy of its own: eviction writes anywhere in a row's blocks
        src_slots = self.kv.slots(src, 0, used)
        self._move(src_slots.expand(*self.positions.shape[:2], -1), self.kv.slots(dst, 0, used))
        for per_row in (self.kept, self.region, self.seen, self.prompt_of):
            per_row[dst] = per_row[src]
        self.write_slot[:, dst] = self.write_slot[:, src]
        self.delta[:, dst] = self.delta[:, src]
        self._book()

    def release(self, row):
        self.kv.release(row)
        self.filling.pop(row, None)
        for per_row in (self.kept, self.region, self.seen, self.prompt_of):
            per_row[row] = 0
        self.write_slot[:, row] = 0
        self.delta[:, row] = 0

    # -- decode -----------------------------------------------------------------------------------------------------
    def _prepare_decode(self, rows: torch.Tensor):
        """Room for each row's new token; its block table, and where each (layer, row, head) writes, for every layer."""
        bs = self.block_size
        for row in rows.tolist():
            before = self._capacity(row)
            self.kv.reserve(row, max(int(self.region[row]), int(self.write_slot[:, row].max()) + 1))
            if self.allocation != "uniform" and self._capacity(row) > before:
                # a new block holds another row's old entries, which eviction would take for a narrower head's
                self.positions[:, :, self.kv.slots(row, before, self._capacity(row))] = -1
        table = self.kv.table_tensor(rows.tolist())
        self.read_slots = (table[:, :, None] * bs + torch.arange(bs)).flatten(1).to(self.device)  # [B, W x bs]
        write = self.write_slot[:, rows]  # [L, B, Hkv]
        self.write_flat = (table[None, :, :, None].expand(write.shape[0], -1, -1, write.shape[2])
                           .gather(2, (write // bs)[:, :, None]).squeeze(2) * bs + write % bs).to(self.device)
        self.table = table.to(self.device)
        # a row reads its first slots: the hole an eviction left is filled by now, else the next slot was taken
        self.lengths = torch.maximum(self.region[rows], self.write_slot[0, rows, 0] + 1)
        # under an allocation, a head reads its own count (its first slots) and the new token
        delta = self.delta[:, rows]
        self.head_lengths = (self.kept[rows][None, :, None] + delta + 1) if bool(delta.any()) else None

    def _decode(self, layer, query, key, value, step):
        rows = step.rows
        if layer == 0:  # what every layer's heads attend this step: the kept tokens and the new one
            self.attended = int(self.kept[rows].sum()) + len(rows)
        attended = self.attended
        lengths = self.lengths
        if self.head_lengths is not None:
            lengths = self.head_lengths[layer]
            attended += int(self.delta[layer, rows].sum()) / self.spec.num_kv_heads
        heads = torch.arange(self.spec.num_kv_heads, device=self.device)[None, :]
        slot = self.write_flat[layer]  # [B, Hkv]
        self.kv.keys[layer][heads, slot] = key[:, :, 0]
        self.kv.values[layer][heads, slot] = value[:, :, 0]
        new_pos = step.start[:, None].to(self.device).expand(-1, self.spec.num_kv_heads)
        self.scores[layer][heads, slot] = torch.as_tensor(self.initial_scores(new_pos), dtype=self.scores.dtype,
                                                          device=self.device)
        self.positions[layer][heads, slot] = new_pos
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
                self.seen[row] = int(step.start[0]) + step.q_len
                self.filling[row] += step.q_len
                if step.last_chunk:
                    self._compact(row)
            else:
                self._evict_after_decode(step.rows)
                # the step's index tensors are the next step's to make: none is held (or booked) between passes
                self.read_slots = self.write_flat = self.table = self.head_lengths = None
            self._book()

    def _evict_after_decode(self, rows: torch.Tensor):
        """Each (layer, row, head) drops its lowest-scored token outside the recent window once over budget."""
        self.region[rows] = torch.maximum(self.region[rows], self.write_slot[:, rows].amax(dim=(0, 2)) + 1)
        self.kept[rows] += 1
        self.seen[rows] += 1
        limits = [self.limits(int(n), int(p)) for n, p in zip(self.seen[rows], self.prompt_of[rows])]
        over_mask = self.kept[rows] > torch.tensor([keep for keep, _ in limits])
        over, under = rows[over_mask], rows[~over_mask]
        # the budget grew: each head takes the slot after its own (a row's heads hold kept + delta, in their first slots)
        self.write_slot[:, under] = self.kept[under][None, :, None] + self.delta[:, under]
        if len(over) == 0:
            return
        recent = torch.tensor([r for (_, r), o in zip(limits, over_mask.tolist()) if o])
        used = int(self.region[over].max())
        slots = self.read_slots[over_mask.to(self.device), :used]  # [B', used]: the over-budget rows' slots
        pos = self.positions[:, :, slots]  # [L, Hkv, B', used]
        inside = (torch.arange(used)[None, :] < self.region[over][:, None]).to(self.device)
        window_start = (self.seen[over] - recent)[:, None].to(self.device)
        evictable = inside & (pos >= 0) & (pos < window_start)
        victim = self.scores[:, :, slots].masked_fill(~evictable, float("inf")).argmin(dim=-1)  # [L, Hkv, B']
        if self.allocation != "uniform":  # a head held to its recent window alone drops its oldest entry
            held = inside & (pos >= 0)
            alone = ~evictable.any(dim=-1)
            oldest = pos.masked_fill(~held, torch.iinfo(pos.dtype).max).argmin(dim=-1)
            victim = torch.where(alone, oldest, victim)
        flat = slots[torch.arange(len(over), device=self.device), victim]  # [L, Hkv, B']
        self.positions.scatter_(2, flat, -1)
        self.write_slot[:, over] = victim.transpose(1, 2).cpu()
        self.kept[over] -= 1

    def _book(self):
        s = self.spec
        # a row's slots serve every layer and head: its heads are as wide as its widest (layer, head), so the slots
        # its entries occupy, padding included, are what the device holds for it (the frontier reads them)
        widest = self.kept + self.delta.amax(dim=(0, 2)).clamp(min=0)
        held = int(widest.sum()) + sum(self.filling.values())
        counters = sum(x.nbytes for x in (self.kept, self.region, self.seen, self.prompt_of, self.write_slot,
                                          self.delta))
        kv, pool_kv = held * s.kv_bytes_per_token, self.kv.kv_bytes()
        self.ledger.set("device", f"{self.name} cache", kv=kv, kv_reserved=pool_kv - kv,
                        overhead=self.kv.total_bytes() - pool_kv + counters + self.extra_overhead())

    def finish(self):
        self.kv = None
        self.filling = {}
        self.ledger.set("device", kv=0, kv_reserved=0, overhead=0)

    def stats(self) -> dict:
        return {"block_size": self.block_size, "num_blocks": self.kv.pool.num_blocks if self.kv else None,
                "peak_blocks_used": self.peak_blocks, "allocation": self.allocation}

    def kept_positions(self, layer: int, row: int) -> list[set[int]]:
        """Original token positions each KV head of a row keeps (for tests and the book's overlap figures)."""
        p = self.positions[layer][:, self.kv.slots(row, 0, int(self.region[row]))]
        return [set(h[h >= 0].tolist()) for h in p]


def select_heavy_recent(scores: torch.Tensor, heavy: int, recent: int) -> torch.Tensor:
    """Per head, the last `recent` positions and the `heavy` best-scored earlier ones, sorted. scores: [..., L]."""
    length = scores.shape[-1]
    older = length - recent
    tail = torch.arange(older, length, device=scores.device).expand(*scores.shape[:-1], -1)
    if heavy == 0:
        return tail
    top = scores[..., :older].topk(heavy, dim=-1).indices
    return torch.cat([top.sort(dim=-1).values, tail], dim=-1)
