"""What a batch's rows keep under scored eviction (kvlib.policies.scored_eviction), in one place: the entries, each
with its score and original position (-1 = empty), in a head-major block pool (kvlib.memory.paged_kv), and the
per-row counts that say which of a row's slots hold what. The operations that change them keep them consistent with
each other; which entries to keep is the policy's (its scores and `select`), never this module's.

A row's slot i lies in block `table[i // block_size]` for every layer and KV head alike. Per row: `kept`, the entries
each head keeps at the row's uniform count; `delta` [L, B, Hkv], what a head keeps beyond it under an uneven
allocation (set when a prompt is compacted, fixed while decode evicts); `region`, the slots the row has used, a hole
an eviction left included; `write_slot` [L, B, Hkv], where each head's next entry goes; `seen`, the tokens the row has
processed; `prompt_of`, the tokens seen when its last prefill ended, or its last compression that restarted its
limits (the base its limits count from). A prefilling row's entries are counted in `filling` until it is compacted.

`per_head_counts` (an allocation other than uniform): a head's slots past its own count are marked empty, and a head
held to its recent window alone evicts its oldest entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvlib.memory.block_pool import PoolRoom
from kvlib.memory.paged_kv import PagedKV, PerSlot
from kvlib.models.passes import Step

SLOT_ARRAYS = {"scores": PerSlot(torch.float32, 0.0), "positions": PerSlot(torch.long, -1)}

Limits = Callable[[int, int], tuple[int, int]]  # (seen, prompt) -> (tokens a head keeps, of which the most recent)


@dataclass
class KeptTokens:
    """A batch's kept entries and the counts that place them (the module's docstring)."""

    kv: PagedKV
    kept: torch.Tensor  # [B]
    region: torch.Tensor  # [B]
    seen: torch.Tensor  # [B]
    write_slot: torch.Tensor  # [L, B, Hkv]
    prompt_of: torch.Tensor  # [B]
    # it sums to about zero over a row's heads and layers (Ada-KV's formula rounds head by head)
    delta: torch.Tensor  # [L, B, Hkv]
    per_head_counts: bool
    filling: dict[int, int] = field(default_factory=dict)
    # a decode step's, from prepare_decode to end_decode
    read_slots: torch.Tensor | None = None
    write_flat: torch.Tensor | None = None
    table: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    head_lengths: torch.Tensor | None = None

    @classmethod
    def allocate(cls, spec, device, num_blocks: int, block_size: int, batch_size: int,
                 per_head_counts: bool) -> KeptTokens:
        def per_row():
            return torch.zeros(batch_size, dtype=torch.long)

        def per_head():
            return torch.zeros((spec.num_layers, batch_size, spec.num_kv_heads), dtype=torch.long)
        return cls(PagedKV.allocate(spec, device, num_blocks, block_size, SLOT_ARRAYS), per_row(), per_row(),
                   per_row(), per_head(), per_row(), per_head(), per_head_counts)

    @property
    def device(self) -> torch.device:
        return self.kv.keys.device

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @staticmethod
    def block_bytes(spec, block_size: int) -> int:
        return PagedKV.block_bytes(spec, block_size, SLOT_ARRAYS)

    @property
    def scores(self) -> torch.Tensor:
        return self.kv.per_slot["scores"]  # [L, Hkv, slots]

    @property
    def positions(self) -> torch.Tensor:
        return self.kv.per_slot["positions"]

    def capacity(self, row: int) -> int:
        return len(self.kv.table(row).blocks) * self.block_size

    def uneven(self, row: int) -> bool:
        """Whether the row's heads hold different counts."""
        return bool(self.delta[:, row].any())

    def move(self, src: torch.Tensor, dst: torch.Tensor):
        """Every per-slot array: slots src [L, Hkv, n] (flat, per layer and head) to slots dst [n] (the same for every
        layer and head); gathered first, so the two may overlap."""
        d = self.kv.keys.shape[-1]
        for cache in (self.kv.keys, self.kv.values):
            cache[:, :, dst] = cache.gather(2, src[..., None].expand(-1, -1, -1, d))
        for array in self.kv.per_slot.values():
            array[:, :, dst] = array.gather(2, src)

    def _by_position(self, row: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the row's used slots, [L, Hkv, count] indices into them of its entries in position order)."""
        slots = self.kv.slots(row, 0, int(self.region[row]))
        pos = self.positions[:, :, slots]
        return slots, pos.masked_fill(pos < 0, torch.iinfo(pos.dtype).max).argsort(dim=-1)[..., :count]

    # -- a prompt --------------------------------------------------------------------------------------------------
    def open_prompt(self, row: int, new_tokens: int):
        """A row's prefill begins: room for what it keeps (moved to its first slots, in position order) plus the
        whole new prompt, reserved now so that a prompt that does not fit fails before any compute."""
        kept = int(self.kept[row])
        self.kv.reserve(row, self.prompt_slots(row, new_tokens))
        if kept:
            slots, order = self._by_position(row, kept)
            self.move(slots[order], slots[:kept])
            self.kept[row] = 0  # the entries now count as the prompt's until the row is compacted again
        self.filling[row] = kept

    def room(self, step: Step) -> PoolRoom:
        """What the pass's prepare reserves (open_prompt, prepare_decode), against the pool's free blocks."""
        if step.phase == "decode":
            return self.kv.room([(row, self.decode_slots(row)) for row in step.rows.tolist()])
        row = int(step.rows[0])  # a prompt's slots are all reserved at its first pass
        opening = row not in self.filling
        return self.kv.room([(row, self.prompt_slots(row, int(step.end[0]) - int(step.start[0])))] * opening)

    def prompt_slots(self, row: int, new_tokens: int) -> int:
        """The slots a row's prefill of new_tokens holds: what it keeps plus the whole prompt, or what it used."""
        return max(int(self.region[row]), int(self.kept[row]) + new_tokens)

    def decode_slots(self, row: int) -> int:
        """The slots a decoding row holds once its next token is written."""
        return max(int(self.region[row]), int(self.write_slot[:, row].max()) + 1)

    def store_prompt(self, layer: int, slots: torch.Tensor, key, value, positions, scores):
        """A prefill pass's new entries (key, value [Hkv, T, D]) into the row's slots [T]."""
        self.kv.keys[layer].index_copy_(1, slots, key)
        self.kv.values[layer].index_copy_(1, slots, value)
        self.positions[layer][:, slots] = positions
        self.scores[layer][:, slots] = scores

    def prompt_scores(self, row: int) -> torch.Tensor:
        """[L, Hkv, filled] the scores of what a prefilling row holds, in slot order."""
        return self.scores[:, :, self.kv.slots(row, 0, self.filling[row])]

    def compact(self, row: int, chosen: torch.Tensor, counts: torch.Tensor, keep: int):
        """End of a row's prefill: per head, the entries `chosen` [L, Hkv, width] (indices into what it holds, in
        position order; a head's first counts [L, Hkv] of them, then padding) move to its first slots, and the blocks
        past them go back to the pool. keep: the row's uniform count."""
        filled = self.filling.pop(row)
        self.prompt_of[row] = self.seen[row]
        slots = self.kv.slots(row, 0, filled)
        width = chosen.shape[-1]
        self.move(slots[chosen], slots[:width])
        self.kv.truncate(row, width)
        if self.per_head_counts:  # a narrower head's slots past its count hold nothing, to its blocks' end
            held = self.kv.slots(row, 0, self.capacity(row))
            beyond = torch.arange(len(held))[None, None, :] >= counts[..., None]
            self.positions[:, :, held] = self.positions[:, :, held].masked_fill(beyond.to(self.device), -1)
        self.kept[row], self.region[row] = keep, width
        self.delta[:, row] = counts - keep
        self.write_slot[:, row] = counts

    def compress(self, row: int, keep: int, select: Callable[[torch.Tensor], torch.Tensor], restart_limits: bool):
        """A decoding row keeps `keep` entries a head: those `select` picks from its scores [L, Hkv, held] in position
        order (indices into them, sorted), moved to its first slots; the blocks past them go back to the pool.
        restart_limits: its limits count from here (prompt_of = seen), else from its last prefill still."""
        slots, order = self._by_position(row, int(self.kept[row]))
        chosen = order.gather(-1, select(self.scores[:, :, slots].gather(-1, order)))
        self.move(slots[chosen], slots[:keep])
        self.kv.truncate(row, keep)
        self.kept[row] = self.region[row] = keep
        self.write_slot[:, row] = keep
        if restart_limits:
            self.prompt_of[row] = self.seen[row]

    # -- decode ----------------------------------------------------------------------------------------------------
    def prepare_decode(self, rows: torch.Tensor):
        """Room for each row's new token; its block table (`table`, `read_slots`), where each (layer, row, head)
        writes (`write_flat`), and what it reads (`lengths`, and `head_lengths` where heads hold different counts)."""
        bs = self.block_size
        for row in rows.tolist():
            before = self.capacity(row)
            self.kv.reserve(row, self.decode_slots(row))
            if self.per_head_counts and self.capacity(row) > before:
                # a new block holds another row's old entries, which eviction would take for a narrower head's
                self.positions[:, :, self.kv.slots(row, before, self.capacity(row))] = -1
        table = self.kv.table_tensor(rows.tolist())
        self.read_slots = (table[:, :, None] * bs + torch.arange(bs)).flatten(1).to(self.device)  # [B, W x bs]
        write = self.write_slot[:, rows]  # [L, B, Hkv]
        self.write_flat = (table[None, :, :, None].expand(write.shape[0], -1, -1, write.shape[2])
                           .gather(2, (write // bs)[:, :, None]).squeeze(2) * bs + write % bs).to(self.device)
        self.table = table.to(self.device)
        # a row reads its first slots: the hole an eviction left is filled by now, else the next slot was taken
        self.lengths = torch.maximum(self.region[rows], self.write_slot[0, rows, 0] + 1)
        delta = self.delta[:, rows]
        self.head_lengths = (self.kept[rows][None, :, None] + delta + 1) if bool(delta.any()) else None

    def append(self, layer: int, key, value, positions, scores):
        """A decode step's new entries (key, value [B, Hkv, D], positions, scores [B, Hkv]) where prepare_decode
        placed them."""
        heads = torch.arange(key.shape[1], device=self.device)[None, :]
        slot = self.write_flat[layer]  # [B, Hkv]
        self.kv.keys[layer][heads, slot] = key
        self.kv.values[layer][heads, slot] = value
        self.scores[layer][heads, slot] = scores
        self.positions[layer][heads, slot] = positions

    def add_scores(self, layer: int, probs: torch.Tensor) -> None:
        """Add a decode step's probabilities [B, Hkv, L] (row b = the step's row b) to the slots they were read from."""
        probs = probs[..., :self.read_slots.shape[1]]  # (the PyTorch path on CUDA pads past every row's length)
        slots = self.read_slots[:, None, :probs.shape[-1]].expand(-1, probs.shape[1], -1)
        heads = torch.arange(probs.shape[1], device=self.device)[None, :, None].expand_as(slots)
        # accumulate: padded table entries all point at block 0, and their zeros must not overwrite a real sum there
        self.scores[layer].index_put_((heads, slots), probs.to(self.scores.dtype), accumulate=True)

    def evict_one(self, rows: torch.Tensor, limits: Limits):
        """After a decode step: its new token counted in, each (layer, row, head) of a row over its limits drops its
        lowest-scored entry outside the recent window, and its slot takes the row's next token."""
        self.region[rows] = torch.maximum(self.region[rows], self.write_slot[:, rows].amax(dim=(0, 2)) + 1)
        self.kept[rows] += 1
        self.seen[rows] += 1
        allowed = [limits(int(n), int(p)) for n, p in zip(self.seen[rows], self.prompt_of[rows])]
        over_mask = self.kept[rows] > torch.tensor([keep for keep, _ in allowed])
        over, under = rows[over_mask], rows[~over_mask]
        # the budget grew: each head takes the slot after its own (a row's heads hold kept + delta, in their first slots)
        self.write_slot[:, under] = self.kept[under][None, :, None] + self.delta[:, under]
        if len(over) == 0:
            return
        recent = torch.tensor([r for (_, r), o in zip(allowed, over_mask.tolist()) if o])
        used = int(self.region[over].max())
        slots = self.read_slots[over_mask.to(self.device), :used]  # [B', used]: the over-budget rows' slots
        pos = self.positions[:, :, slots]  # [L, Hkv, B', used]
        inside = (torch.arange(used)[None, :] < self.region[over][:, None]).to(self.device)
        window_start = (self.seen[over] - recent)[:, None].to(self.device)
        evictable = inside & (pos >= 0) & (pos < window_start)
        victim = self.scores[:, :, slots].masked_fill(~evictable, float("inf")).argmin(dim=-1)  # [L, Hkv, B']
        if self.per_head_counts:  # a head held to its recent window alone drops its oldest entry
            held = inside & (pos >= 0)
            alone = ~evictable.any(dim=-1)
            oldest = pos.masked_fill(~held, torch.iinfo(pos.dtype).max).argmin(dim=-1)
            victim = torch.where(alone, oldest, victim)
        flat = slots[torch.arange(len(over), device=self.device), victim]  # [L, Hkv, B']
        self.positions.scatter_(2, flat, -1)
        self.write_slot[:, over] = victim.transpose(1, 2).cpu()
        self.kept[over] -= 1

    def end_decode(self):
        """The step's index tensors are the next step's to make: none is held (or booked) between passes."""
        self.read_slots = self.write_flat = self.table = self.lengths = self.head_lengths = None

    # -- rows ------------------------------------------------------------------------------------------------------
    def fork(self, src: int, dst: int):
        """dst becomes a copy of src of its own (eviction writes anywhere in a row's blocks)."""
        used = int(self.region[src])
        self.release(dst)
        self.kv.reserve(dst, used)
        self.move(self.kv.slots(src, 0, used).expand(*self.positions.shape[:2], -1), self.kv.slots(dst, 0, used))
        for per_row in (self.kept, self.region, self.seen, self.prompt_of):
            per_row[dst] = per_row[src]
        self.write_slot[:, dst] = self.write_slot[:, src]
        self.delta[:, dst] = self.delta[:, src]

    def release(self, row: int):
        self.kv.release(row)
        self.filling.pop(row, None)
        for per_row in (self.kept, self.region, self.seen, self.prompt_of):
            per_row[row] = 0
        self.write_slot[:, row] = 0
        self.delta[:, row] = 0

    def held_slots(self) -> int:
        """The slots the rows' entries occupy, padding included: a row's slots serve every layer and head, so its
        heads are as wide as its widest (layer, head), and a prefilling row holds what it has filled."""
        widest = self.kept + self.delta.amax(dim=(0, 2)).clamp(min=0)
        return int(widest.sum()) + sum(self.filling.values())

    def counter_bytes(self) -> int:
        return sum(x.nbytes for x in (self.kept, self.region, self.seen, self.prompt_of, self.write_slot, self.delta))

    def kept_positions(self, layer: int, row: int) -> list[set[int]]:
        """Original token positions each KV head of a row keeps."""
        p = self.positions[layer][:, self.kv.slots(row, 0, int(self.region[row]))]
        return [set(h[h >= 0].tolist()) for h in p]
