"""The mechanism shared by the policies that keep, per KV head, the best-scored tokens within a budget (H2O,
StreamingLLM, SnapKV): the scoring (what to keep) lives in each policy, the storage, compaction and freeing here.

Storage: per layer, row and KV head a compact array of `cap` slots (keys, values, a float score and the token's
original position, -1 = empty). A row's prefill goes into a prompt buffer sized for what the row keeps plus the whole
new prompt (booked before it is allocated, so a prompt that does not fit fails before any compute); when its last chunk
is in, `select` picks per head the `keep - recent` best-scored older tokens plus the `recent` newest and they are
gathered, in position order, into the row's slots. At decode the new token takes a free slot; once a row holds more
than `limits` allows, each (layer, row, head) drops its lowest-scored token outside the recent window and its slot is
reused. Every byte is booked: the kept entries as `kv`, the rest of the slots and buffers as `kv_reserved`, scores and
positions (4 + 8 bytes an entry) as `overhead`.

Decode reads each row's slots in place through the decode attention every policy shares (kvlib.kernels.decode): the
slots a row holds are always its first ones (a new token fills the hole the last eviction left, or the next slot), so a
row's length is all the kernel needs, the same for each of its KV heads.

A subclass gives `limits` (tokens kept and protected-recent for a row) and, where it scores, the hooks: the score a new
entry starts with (`initial_scores`), the prefill attention (`prefill_attention_of`, which may score the buffer), and
`update_scores` with each decode step's attention probabilities (`decode_scores`: it asks the kernel for them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlib.errors import UserError
from kvlib.kernels.attention import prefill_attention
from kvlib.kernels.decode import DecodeReads
from kvlib.policies.base import BudgetedPolicy, Step


@dataclass
class PromptBuffer:
    """A row's prompt during its prefill, every layer: [L, Hkv, size, D] keys/values, [L, Hkv, size] scores and
    original positions; the first `filled` slots hold tokens."""

    keys: torch.Tensor
    values: torch.Tensor
    scores: torch.Tensor
    positions: torch.Tensor
    filled: int


@dataclass
class ScoredEvictionPolicy(BudgetedPolicy):
    """Keep the top tokens per KV head given scores and a budget; evicted entries are freed for good."""

    decode_scores: ClassVar[bool] = False  # update_scores needs each decode step's attention probabilities

    # -- what a subclass decides ------------------------------------------------------------------------------------
    def limits(self, seen: int, prompt: int) -> tuple[int, int]:
        """(tokens a row keeps per KV head, of which the most recent) once it has seen `seen` tokens, `prompt` of
        them by the end of its last prefill."""
        raise NotImplementedError

    def initial_scores(self, positions: torch.Tensor) -> torch.Tensor | float:
        """The score an entry starts with, given its original position."""
        return 0.0

    def prefill_attention_of(self, layer: int, query, keys, values, scores, begin: int, filled: int, step: Step):
        """Attention of a prompt chunk over the buffer's first `filled` + T entries (keys/values [Hkv, end, D]); may
        add to `scores` [Hkv, end]. begin: the position of the chunk's first token."""
        return prefill_attention(query, keys[None], values[None], filled, step.prefill_mode, self.scale,
                                 self.ledger, layer)

    def decode_reads(self, layer: int, query, rows, lengths) -> tuple[torch.Tensor, DecodeReads]:
        """(query, what each row reads) in a decode step: the rows' first `lengths` slots, in place. StreamingLLM's
        `cache` positions re-rotate a copy of them."""
        return query, DecodeReads(self.keys[layer], self.values[layer], lengths, rows=rows, probs=self.decode_scores)

    def update_scores(self, layer: int, rows: torch.Tensor, probs: torch.Tensor) -> None:
        """After a decode step's attention (where decode_scores): probs [B, Hkv, L], each slot's attention summed over
        the KV head's query group, zeros past a row's length."""

    def select(self, scores: torch.Tensor, heavy: int, recent: int) -> torch.Tensor:
        """Per head, the last `recent` entries and the `heavy` best-scored earlier ones, sorted. scores: [..., n]."""
        return select_heavy_recent(scores, heavy, recent)

    def extra_overhead(self) -> int:
        """Bytes of policy-specific state held between passes (booked as overhead)."""
        return 0

    # -- lifecycle --------------------------------------------------------------------------------------------------
    def start(self, batch_size, prompt_lens, max_new_tokens):
        if self.budget_tokens is not None and self.budget_tokens > min(prompt_lens):
            raise UserError(f"budget_tokens={self.budget_tokens} exceeds the shortest prompt "
                            f"({min(prompt_lens)} tokens)")
        s = self.spec
        # one slot more than the budget: the new token is stored before the step's eviction frees one
        self.cap = max(self.limits(n + max_new_tokens, n)[0] for n in prompt_lens) + 1
        shape = (s.num_layers, batch_size, s.num_kv_heads, self.cap)
        self.ledger.add("device", "kv_reserved", s.kv_bytes(batch_size * self.cap), where=f"{self.name} cache "
                        "allocation")
        self.ledger.add("device", "overhead", math.prod(shape) * (4 + 8), where=f"{self.name} scores")
        self.keys = torch.zeros((*shape, s.head_dim), dtype=s.dtype, device=self.device)
        self.values = torch.zeros_like(self.keys)
        self.scores = torch.zeros(shape, device=self.device)
        self.positions = torch.full(shape, -1, dtype=torch.long, device=self.device)  # -1 = empty slot
        self.kept = torch.zeros(batch_size, dtype=torch.long)  # tokens a row keeps (per head, every layer)
        self.region = torch.zeros(batch_size, dtype=torch.long)  # slots a row has used, a hole included
        self.seen = torch.zeros(batch_size, dtype=torch.long)  # tokens the row has processed
        self.write_slot = torch.zeros(shape[:3], dtype=torch.long)  # where each (layer, row, head) stores next
        self.prompt_of = torch.zeros(batch_size, dtype=torch.long)  # tokens seen when the row's last prefill ended
        self.prefill_kv: dict[int, PromptBuffer] = {}

    def attend(self, layer, query, key, value, step: Step):
        if step.phase == "prefill":
            return self._prefill(layer, query, key, value, step)
        return self._decode(layer, query, key, value, step)

    def prepare(self, step: Step):
        if step.phase == "prefill" and int(step.rows[0]) not in self.prefill_kv:
            with self.timers.section("eviction"):
                self._open_prompt(int(step.rows[0]), int(step.end[0]) - int(step.start[0]))

    def _open_prompt(self, row: int, new_tokens: int):
        """A row's prefill begins: a buffer for what it keeps (in position order) plus the whole new prompt."""
        s, layers = self.spec, self.spec.num_layers
        kept, used = int(self.kept[row]), int(self.region[row])
        size = kept + new_tokens
        shape = (layers, s.num_kv_heads, size)
        self.ledger.add("device", "kv_reserved", s.kv_bytes(size), where=f"{self.name} prompt buffer")
        self.ledger.add("device", "overhead", math.prod(shape) * (4 + 8), where=f"{self.name} prompt scores")
        buf = PromptBuffer(torch.zeros((*shape, s.head_dim), dtype=s.dtype, device=self.device),
                           torch.zeros((*shape, s.head_dim), dtype=s.dtype, device=self.device),
                           torch.zeros(shape, device=self.device),
                           torch.full(shape, -1, dtype=torch.long, device=self.device), kept)
        if kept:
            pos = self.positions[:, row, :, :used]
            order = pos.masked_fill(pos < 0, torch.iinfo(pos.dtype).max).argsort(dim=-1)[..., :kept]
            dims = order[..., None].expand(-1, -1, -1, s.head_dim)
            buf.keys[..., :kept, :] = self.keys[:, row].gather(2, dims)
            buf.values[..., :kept, :] = self.values[:, row].gather(2, dims)
            buf.scores[..., :kept] = self.scores[:, row].gather(2, order)
            buf.positions[..., :kept] = pos.gather(2, order)
            self.kept[row] = 0  # the entries now live in the buffer until the row is compacted again
        self.prefill_kv[row] = buf

    def _prefill(self, layer, query, key, value, step):
        row, begin, t = int(step.rows[0]), int(step.start[0]), step.q_len
        buf = self.prefill_kv[row]
        end = buf.filled + t
        positions = torch.arange(begin, begin + t, device=self.device)
        buf.keys[layer, :, buf.filled:end] = key[0]
        buf.values[layer, :, buf.filled:end] = value[0]
        buf.positions[layer, :, buf.filled:end] = positions
        buf.scores[layer, :, buf.filled:end] = self.initial_scores(positions)
        return self.prefill_attention_of(layer, query, buf.keys[layer, :, :end], buf.values[layer, :, :end],
                                         buf.scores[layer, :, :end], begin, buf.filled, step)

    def _compact(self, row: int):
        """End of a row's prefill: keep what `select` picks, in position order, per head."""
        buf = self.prefill_kv.pop(row)
        seen = int(self.seen[row])
        self.prompt_of[row] = seen
        keep, recent = self.limits(seen, seen)
        keep = min(keep, buf.filled)  # a conversation's row holds less than it has seen: earlier turns were evicted
        recent = min(recent, keep)
        if keep >= self.cap:
            raise UserError(f"row {row} grew to {seen} tokens, past the lengths given to start()")
        idx = self.select(buf.scores[..., :buf.filled], keep - recent, recent)  # [L, Hkv, keep]
        dims = idx[..., None].expand(-1, -1, -1, self.spec.head_dim)
        self.keys[:, row, :, :keep] = buf.keys.gather(2, dims)
        self.values[:, row, :, :keep] = buf.values.gather(2, dims)
        self.scores[:, row, :, :keep] = buf.scores.gather(2, idx)
        self.positions[:, row, :, :keep] = buf.positions.gather(2, idx)
        self.positions[:, row, :, keep:] = -1
        self.kept[row] = self.region[row] = keep
        self.write_slot[:, row] = keep

    def fork(self, src, dst):
        if src in self.prefill_kv:
            raise UserError(f"row {src} is in the middle of a prefill and cannot be forked")
        for cache in (self.keys, self.values, self.scores, self.positions, self.write_slot):
            cache[:, dst] = cache[:, src]
        for per_row in (self.kept, self.region, self.seen, self.prompt_of):
            per_row[dst] = per_row[src]
        self._book()

    # -- decode -----------------------------------------------------------------------------------------------------
    def _decode(self, layer, query, key, value, step):
        rows = step.rows
        if layer == 0:  # what every layer's heads attend this step: the kept tokens and the new one
            self.attended = int(self.kept[rows].sum()) + len(rows)
        r, heads = rows[:, None], torch.arange(self.spec.num_kv_heads)
        slot = self.write_slot[layer, rows]  # [B, Hkv]
        kc, vc = self.keys[layer], self.values[layer]
        kc[r, heads, slot] = key[:, :, 0]
        vc[r, heads, slot] = value[:, :, 0]
        new_pos = step.start[:, None].to(self.device).expand(-1, len(heads))
        self.scores[layer, r, heads, slot] = self.initial_scores(new_pos)
        self.positions[layer, r, heads, slot] = new_pos
        # a row reads its first slots: the hole an eviction left is filled by now, else the next slot was taken
        lengths = torch.maximum(self.region[rows], self.write_slot[layer, rows, 0] + 1)
        q, reads = self.decode_reads(layer, query, rows, lengths)
        copied = 0 if reads.keys.untyped_storage().data_ptr() == self.keys.untyped_storage().data_ptr() else \
            reads.keys.nbytes + reads.values.nbytes
        with self.ledger.transient("device", "activations", copied, f"{self.name} decode rows, layer {layer}"):
            out, probs = self.decode_attention(layer, q, reads)
        if probs is not None:
            self.update_scores(layer, rows, probs[..., :self.cap])
        self.usage.add(layer, self.attended, step.tokens_seen, len(rows))
        return out

    def after_pass(self, step: Step):
        with self.timers.section("eviction"):
            if step.phase == "prefill":
                self.seen[step.rows] = step.start + step.q_len
                self.prefill_kv[int(step.rows[0])].filled += step.q_len
                if step.last_chunk:
                    self._compact(int(step.rows[0]))
            else:
                self._evict_after_decode(step.rows)
            self._book()

    def _evict_after_decode(self, rows: torch.Tensor):
        """Each (layer, row, head) drops its lowest-scored token outside the recent window once over budget."""
        self.region[rows] = torch.maximum(self.region[rows], self.write_slot[0, rows, 0] + 1)
        self.kept[rows] += 1
        self.seen[rows] += 1
        limits = [self.limits(int(n), int(p)) for n, p in zip(self.seen[rows], self.prompt_of[rows])]
        allowed = torch.tensor([keep for keep, _ in limits])
        over_mask = self.kept[rows] > allowed
        over, under = rows[over_mask], rows[~over_mask]
        self.write_slot[:, under] = self.region[under][None, :, None]  # the budget grew: take a fresh slot
        if len(over) == 0:
            return
        recent = torch.tensor([r for (_, r), o in zip(limits, over_mask.tolist()) if o])
        window_start = (self.seen[over] - recent)[None, :, None, None].to(self.device)
        pos = self.positions[:, over]
        evictable = (pos >= 0) & (pos < window_start)
        victim = self.scores[:, over].masked_fill(~evictable, float("inf")).argmin(dim=-1)  # [L, B, Hkv]
        self.positions[:, over] = pos.scatter(-1, victim[..., None], -1)
        self.write_slot[:, over] = victim.cpu()
        self.kept[over] -= 1

    def _book(self):
        s = self.spec
        kept = int(self.kept.sum())
        buffered = sum(buf.filled for buf in self.prefill_kv.values())
        buffer_slots = sum(buf.keys.shape[2] for buf in self.prefill_kv.values())
        self.ledger.set("device", f"{self.name} cache", kv=(kept + buffered) * s.kv_bytes_per_token,
                        kv_reserved=s.kv_bytes(self.keys.shape[1] * self.cap + buffer_slots - kept - buffered),
                        overhead=(self.scores.numel() + s.num_layers * s.num_kv_heads * buffer_slots) * (4 + 8)
                        + self.extra_overhead())

    def finish(self):
        self.keys = self.values = self.scores = self.positions = None
        self.prefill_kv = {}
        self.ledger.set("device", kv=0, kv_reserved=0, overhead=0)

    def kept_positions(self, layer: int, row: int) -> list[set[int]]:
        """Original token positions each KV head of a row keeps (for tests and the book's overlap figures)."""
        return [set(p[p >= 0].tolist()) for p in self.positions[layer, row]]


def select_heavy_recent(scores: torch.Tensor, heavy: int, recent: int) -> torch.Tensor:
    """Per head, the last `recent` positions and the `heavy` best-scored earlier ones, sorted. scores: [..., L]."""
    length = scores.shape[-1]
    older = length - recent
    tail = torch.arange(older, length, device=scores.device).expand(*scores.shape[:-1], -1)
    if heavy == 0:
        return tail
    top = scores[..., :older].topk(heavy, dim=-1).indices
    return torch.cat([top.sort(dim=-1).values, tail], dim=-1)
