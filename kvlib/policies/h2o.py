"""H2O (Zhang et al., 2023): keep the heavy hitters and a recent window, evict the rest for good.

Per KV head (the query heads of a GQA group summed), each cached token accumulates the attention it receives from every
later query. After a prompt is prefilled, and after every decode step, a row keeps `recent` newest tokens plus the
`heavy` tokens with the highest accumulated score among the others; the evicted entries are dropped and their memory
is released. What the budget means (`budget_rule`, tokens kept per KV head):
- `seen` (default): heavy + recent = round(budget x tokens seen so far), split by `recent_ratio`; it grows with the
  generated tokens, so budget 1.0 keeps everything. `budget_tokens` fixes the total instead.
- `flexgen`: the H2O authors' FlexGen implementation, which the paper ran ("heavy-hitter ratio 0.3"): heavy = recent =
  int(budget x prompt length) (or `budget_tokens` each), fixed during decode, so ratio 0.3 keeps ~60 % of the prompt.

Prefill needs attention probabilities, so it runs with a materialized attention matrix: `full` builds the L x L matrix
(the memory wall the paper hits), `chunked` builds C x L per chunk. With `chunk_scoring="accumulate"` every chunk's
queries score all earlier tokens, so the kept set equals full prefill's (the fix the paper proposes); the prompt's KV is
held until its last chunk in a buffer sized for the whole prompt at its first chunk (booked then, so a prompt that does
not fit fails before any compute), which bounds the matrix, not the KV. `chunk_scoring="per_chunk"` is the variant the
paper measured: a token is scored only by queries of its own chunk. `fused` prefill computes no probabilities: refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlib.attention import causal_mask, matrix_attention, matrix_bytes
from kvlib.errors import UserError
from kvlib.policies.base import BudgetedPolicy, Step
from kvlib.policies.registry import register

CHUNK_SCORING = ("accumulate", "per_chunk")
BUDGET_RULES = ("seen", "flexgen")


@register
@dataclass
class HeavyHitterPolicy(BudgetedPolicy):
    name = "h2o"
    supported_prefill = ("full", "chunked")
    preferred_prefill = "chunked"  # with cross-chunk accumulation: full prefill's kept set without its L x L matrix

    recent_ratio: float = 0.5  # share of the budget given to the recent window (the H2O paper splits it evenly)
    chunk_scoring: str = "accumulate"
    budget_rule: str = "seen"

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.recent_ratio <= 1:
            raise UserError(f"recent_ratio must be in [0, 1], got {self.recent_ratio}")
        if self.chunk_scoring not in CHUNK_SCORING:
            raise UserError(f"chunk_scoring must be one of {list(CHUNK_SCORING)}, got {self.chunk_scoring!r}")
        if self.budget_rule not in BUDGET_RULES:
            raise UserError(f"budget_rule must be one of {list(BUDGET_RULES)}, got {self.budget_rule!r}")

    def check_prefill(self, mode):
        if mode == "fused":
            raise UserError("policy 'h2o' needs attention scores, which fused prefill does not compute; "
                            "use --prefill full or --prefill chunked")
        super().check_prefill(mode)

    # -- sizes ---------------------------------------------------------------------------------------------------
    def limits(self, seen: int, prompt: int) -> tuple[int, int]:
        """(tokens a row keeps, of which recent) once it has seen `seen` tokens, `prompt` of them its prompt."""
        if self.budget_rule == "flexgen":
            part = self.budget_tokens if self.budget_tokens is not None else int(self.budget * prompt)
            return min(2 * part, seen), min(part, seen)
        keep = self.tokens_allowed(seen)
        return keep, round(keep * self.recent_ratio)

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def start(self, batch_size, prompt_lens, max_new_tokens):
        if self.budget_tokens is not None and self.budget_tokens > min(prompt_lens):
            raise UserError(f"budget_tokens={self.budget_tokens} (heavy + recent) exceeds the shortest prompt "
                            f"({min(prompt_lens)} tokens)")
        s = self.spec
        # one slot more than the budget: the new token is stored before the step's eviction frees one
        self.cap = max(self.limits(n + max_new_tokens, n)[0] for n in prompt_lens) + 1
        shape = (s.num_layers, batch_size, s.num_kv_heads, self.cap)
        self.ledger.add("device", "kv_reserved", s.kv_bytes(batch_size * self.cap), where="h2o cache allocation")
        self.ledger.add("device", "overhead", math.prod(shape) * (4 + 8), where="h2o scores")
        self.keys = torch.zeros((*shape, s.head_dim), dtype=s.dtype, device=self.device)
        self.values = torch.zeros_like(self.keys)
        self.scores = torch.zeros(shape, device=self.device)  # attention each kept token has received
        self.positions = torch.full(shape, -1, dtype=torch.long, device=self.device)  # -1 = empty slot
        self.kept = torch.zeros(batch_size, dtype=torch.long)  # tokens a row keeps (per head, every layer)
        self.region = torch.zeros(batch_size, dtype=torch.long)  # slots a row has used, a hole included
        self.seen = torch.zeros(batch_size, dtype=torch.long)  # tokens the row has processed
        self.write_slot = torch.zeros(shape[:3], dtype=torch.long)  # where each (layer, row, head) stores next
        self.prompt_of = torch.zeros(batch_size, dtype=torch.long)  # tokens seen when the row's last prefill ended
        self.prefill_kv: dict[int, PromptBuffer] = {}  # a row's prompt, held whole until its last chunk

    def attend(self, layer, query, key, value, step: Step):
        if step.phase == "prefill":
            return self._prefill(layer, query, key, value, step)
        return self._decode(layer, query, key, value, step)

    # -- prefill ---------------------------------------------------------------------------------------------------
    def prepare(self, step: Step):
        if step.phase == "prefill" and int(step.rows[0]) not in self.prefill_kv:
            with self.timers.section("eviction"):
                self._open_prompt(int(step.rows[0]), int(step.end[0]) - int(step.start[0]))

    def _open_prompt(self, row: int, new_tokens: int):
        """A row's prefill begins: a buffer for what it keeps (the entries kept of earlier turns, in position order)
        plus the whole new prompt, booked before it is allocated."""
        s, layers = self.spec, self.spec.num_layers
        kept, used = int(self.kept[row]), int(self.region[row])
        size = kept + new_tokens
        shape = (layers, s.num_kv_heads, size)
        self.ledger.add("device", "kv_reserved", s.kv_bytes(size), where="h2o prompt buffer")
        self.ledger.add("device", "overhead", math.prod(shape) * (4 + 8), where="h2o prompt scores")
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
        """A chunk's queries see what the row holds (its earlier chunks, or the entries it kept of earlier turns) and,
        causally, the chunk itself; every held entry's score accumulates the attention it receives."""
        row, begin, t = int(step.rows[0]), int(step.start[0]), step.q_len
        buf = self.prefill_kv[row]
        end = buf.filled + t
        buf.keys[layer, :, buf.filled:end] = key[0]
        buf.values[layer, :, buf.filled:end] = value[0]
        buf.positions[layer, :, buf.filled:end] = torch.arange(begin, begin + t, device=self.device)
        k, v, scores = buf.keys[layer, :, :end], buf.values[layer, :, :end], buf.scores[layer, :, :end]
        nbytes = matrix_bytes(1, self.spec.num_attention_heads, t, end, self.spec.dtype_bytes)
        with self.ledger.transient("device", "activations", nbytes, where=f"attention matrix, layer {layer}"):
            out, probs = matrix_attention(query, k[None], v[None], causal_mask(t, end, self.device), self.scale)
            with self.timers.section("eviction"):
                received = probs[0].sum(dim=(1, 2))  # [Hkv, end]: summed over the group's query heads and queries
                if self.chunk_scoring == "per_chunk":
                    scores[:, -t:] += received[:, -t:]
                else:
                    scores += received
        return out

    def _compact(self, row: int):
        """End of a row's prefill: keep its heavy hitters and recent window, in position order, per head."""
        buf = self.prefill_kv.pop(row)
        seen = int(self.seen[row])
        self.prompt_of[row] = seen
        keep, recent = self.limits(seen, seen)
        keep = min(keep, buf.filled)  # a conversation's row holds less than it has seen: earlier turns were evicted
        recent = min(recent, keep)
        if keep >= self.cap:
            raise UserError(f"row {row} grew to {seen} tokens, past the lengths given to start()")
        idx = select_heavy_recent(buf.scores[..., :buf.filled], keep - recent, recent)  # [L, Hkv, keep]
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

    # -- decode ----------------------------------------------------------------------------------------------------
    def _decode(self, layer, query, key, value, step):
        rows = step.rows
        if layer == 0:  # what every layer's heads attend this step: the kept tokens and the new one
            self.attended = int(self.kept[rows].sum()) + len(rows)
        r, heads = rows[:, None], torch.arange(self.spec.num_kv_heads)
        slot = self.write_slot[layer, rows]  # [B, Hkv]
        kc, vc = self.keys[layer], self.values[layer]
        kc[r, heads, slot] = key[:, :, 0]
        vc[r, heads, slot] = value[:, :, 0]
        self.scores[layer, r, heads, slot] = 0.0
        self.positions[layer, r, heads, slot] = step.start[:, None].to(self.device)
        used = int(self.region[rows].max()) + 1
        with self.rows_of(rows, kc, vc, self.positions[layer], where=f"h2o decode rows, layer {layer}") as (k, v, pos):
            visible = pos[:, :, :used] >= 0  # [B, Hkv, used]: per-head kept sets
            out, probs = matrix_attention(query, k[:, :, :used], v[:, :, :used], visible[:, :, None, None, :],
                                          self.scale)
        with self.timers.section("eviction"):
            self.scores[layer, rows, :, :used] += probs.sum(dim=(2, 3))  # no head_dim axis: a cheap copy
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
        self.ledger.set("device", "h2o cache", kv=(kept + buffered) * s.kv_bytes_per_token,
                        kv_reserved=s.kv_bytes(self.keys.shape[1] * self.cap + buffer_slots - kept - buffered),
                        overhead=(self.scores.numel() + s.num_layers * s.num_kv_heads * buffer_slots) * (4 + 8))

    def finish(self):
        self.keys = self.values = self.scores = self.positions = None
        self.prefill_kv = {}
        self.ledger.set("device", kv=0, kv_reserved=0, overhead=0)

    def kept_positions(self, layer: int, row: int) -> list[set[int]]:
        """Original token positions each KV head of a row keeps (for tests and the book's overlap figures)."""
        return [set(p[p >= 0].tolist()) for p in self.positions[layer, row]]


@dataclass
class PromptBuffer:
    """A row's prompt during its prefill, every layer: [L, Hkv, size, D] keys/values, [L, Hkv, size] scores and
    original positions; the first `filled` slots hold tokens."""

    keys: torch.Tensor
    values: torch.Tensor
    scores: torch.Tensor
    positions: torch.Tensor
    filled: int


def select_heavy_recent(scores: torch.Tensor, heavy: int, recent: int) -> torch.Tensor:
    """Per head, the last `recent` positions and the `heavy` best-scored earlier ones, sorted. scores: [..., L]."""
    length = scores.shape[-1]
    older = length - recent
    tail = torch.arange(older, length, device=scores.device).expand(*scores.shape[:-1], -1)
    if heavy == 0:
        return tail
    top = scores[..., :older].topk(heavy, dim=-1).indices
    return torch.cat([top.sort(dim=-1).values, tail], dim=-1)

