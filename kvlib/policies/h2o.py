"""H2O (Zhang et al., 2023): keep the heavy hitters and a recent window, evict the rest for good.

Per KV head (the query heads of a GQA group summed), each cached token accumulates the attention it receives from every
later query. After a prompt is prefilled, and after every decode step, a row keeps `recent` newest tokens plus the
`heavy` tokens with the highest accumulated score among the others; the evicted entries are dropped and their memory
is released. The budget is a fraction of the tokens seen so far (prompt plus generated), so budget 1.0 keeps
everything, or a fixed number of tokens (`budget_tokens`).

Prefill needs attention probabilities, so it runs with a materialized attention matrix: `full` builds the L x L matrix
(the memory wall the paper hits), `chunked` builds C x L per chunk. With `chunk_scoring="accumulate"` every chunk's
queries score all earlier tokens, so the kept set equals full prefill's (the fix the paper proposes); the prompt's KV is
held until its last chunk, which bounds the matrix, not the KV. `chunk_scoring="per_chunk"` is the variant the paper
measured: a token is scored only by queries of its own chunk. `fused` prefill computes no probabilities: refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlib.attention import causal_mask, matrix_attention, matrix_bytes
from kvlib.errors import UserError
from kvlib.policies.base import BudgetedPolicy, Step, select_rows

CHUNK_SCORING = ("accumulate", "per_chunk")


@dataclass
class HeavyHitterPolicy(BudgetedPolicy):
    name = "h2o"
    supported_prefill = ("full", "chunked")
    preferred_prefill = "chunked"  # with cross-chunk accumulation: full prefill's kept set without its L x L matrix

    recent_ratio: float = 0.5  # share of the budget given to the recent window (the H2O paper splits it evenly)
    chunk_scoring: str = "accumulate"

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.recent_ratio <= 1:
            raise UserError(f"recent_ratio must be in [0, 1], got {self.recent_ratio}")
        if self.chunk_scoring not in CHUNK_SCORING:
            raise UserError(f"chunk_scoring must be one of {list(CHUNK_SCORING)}, got {self.chunk_scoring!r}")

    def check_prefill(self, mode):
        if mode == "fused":
            raise UserError("policy 'h2o' needs attention scores, which fused prefill does not compute; "
                            "use --prefill full or --prefill chunked")
        super().check_prefill(mode)

    # -- sizes ---------------------------------------------------------------------------------------------------
    def allowed(self, seen: int) -> int:
        """Tokens a row may keep after it has seen `seen` tokens."""
        if self.budget_tokens is not None:
            return min(self.budget_tokens, seen)
        return min(seen, max(1, round(self.budget * seen)))

    def split(self, keep: int) -> tuple[int, int]:
        """(heavy, recent) for a row that keeps `keep` tokens."""
        recent = round(keep * self.recent_ratio)
        return keep - recent, recent

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def start(self, batch_size, prompt_lens, max_new_tokens):
        if self.budget_tokens is not None and self.budget_tokens > min(prompt_lens):
            raise UserError(f"budget_tokens={self.budget_tokens} (heavy + recent) exceeds the shortest prompt "
                            f"({min(prompt_lens)} tokens)")
        s = self.spec
        # one slot more than the budget: the new token is stored before the step's eviction frees one
        self.cap = max(self.allowed(n + max_new_tokens) for n in prompt_lens) + 1
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
        self.prefill_kv: dict[int, list] = {}  # row -> per layer [K, V, scores, positions] until its last chunk

    def attend(self, layer, query, key, value, step: Step):
        if step.phase == "prefill":
            return self._prefill(layer, query, key, value, step)
        return self._decode(layer, query, key, value, step)

    # -- prefill ---------------------------------------------------------------------------------------------------
    def _prefill(self, layer, query, key, value, step):
        """A chunk's queries see what the row holds (its earlier chunks, or the entries it kept of earlier turns) and,
        causally, the chunk itself; every held entry's score accumulates the attention it receives."""
        row, begin, t = int(step.rows[0]), int(step.start[0]), step.q_len
        held = self.prefill_kv.setdefault(row, [None] * self.spec.num_layers)
        if held[layer] is None:
            held[layer] = self._reopen(layer, row)
        k, v, scores, positions = held[layer]
        new_positions = torch.arange(begin, begin + t, device=self.device).expand(key.shape[1], -1)
        k, v = torch.cat([k, key[0]], 1), torch.cat([v, value[0]], 1)
        scores = torch.cat([scores, scores.new_zeros(key.shape[1], t)], 1)
        held[layer] = [k, v, scores, torch.cat([positions, new_positions], 1)]
        length = k.shape[1]
        nbytes = matrix_bytes(1, self.spec.num_attention_heads, t, length, self.spec.dtype_bytes)
        with self.ledger.transient("device", "activations", nbytes, where=f"attention matrix, layer {layer}"):
            out, probs = matrix_attention(query, k[None], v[None], causal_mask(t, length, self.device), self.scale)
            received = probs[0].sum(dim=(1, 2))  # [Hkv, length]: summed over the group's query heads and the queries
        if self.chunk_scoring == "per_chunk":
            scores[:, -t:] += received[:, -t:]
        else:
            scores += received
        return out

    def _reopen(self, layer: int, row: int) -> list[torch.Tensor]:
        """What a row keeps in one layer, as the start of a new prefill: nothing for a fresh row, the kept entries
        (in position order) when a conversation goes on after decoding."""
        kept, used = int(self.kept[row]), int(self.region[row])
        pos = self.positions[layer, row, :, :used]
        order = pos.masked_fill(pos < 0, torch.iinfo(pos.dtype).max).argsort(dim=1)[:, :kept]
        if layer == self.spec.num_layers - 1:
            self.kept[row] = 0  # the entries now live in the prefill state until the row is compacted again
        dims = order[..., None].expand(-1, -1, self.spec.head_dim)
        return [self.keys[layer, row].gather(1, dims), self.values[layer, row].gather(1, dims),
                self.scores[layer, row].gather(1, order), pos.gather(1, order)]

    def _compact(self, row: int):
        """End of a row's prefill: keep its heavy hitters and recent window, in position order, per head."""
        held = self.prefill_kv.pop(row)
        keep = min(held[0][0].shape[1], self.allowed(int(self.seen[row])))
        if keep >= self.cap:
            raise UserError(f"row {row} grew to {int(self.seen[row])} tokens, past the lengths given to start()")
        heavy, recent = self.split(keep)
        for layer, (k, v, scores, positions) in enumerate(held):
            idx = select_heavy_recent(scores, heavy, recent)
            self.keys[layer, row, :, :keep] = k.gather(1, idx[..., None].expand(-1, -1, k.shape[-1]))
            self.values[layer, row, :, :keep] = v.gather(1, idx[..., None].expand(-1, -1, v.shape[-1]))
            self.scores[layer, row, :, :keep] = scores.gather(1, idx)
            self.positions[layer, row, :, :keep] = positions.gather(1, idx)
            self.positions[layer, row, :, keep:] = -1
        self.kept[row] = self.region[row] = keep
        self.write_slot[:, row] = keep

    def fork(self, src, dst):
        if src in self.prefill_kv:
            raise UserError(f"row {src} is in the middle of a prefill and cannot be forked")
        for cache in (self.keys, self.values, self.scores, self.positions, self.write_slot):
            cache[:, dst] = cache[:, src]
        for per_row in (self.kept, self.region, self.seen):
            per_row[dst] = per_row[src]
        self._book()

    # -- decode ----------------------------------------------------------------------------------------------------
    def _decode(self, layer, query, key, value, step):
        rows = step.rows
        r, heads = rows[:, None], torch.arange(self.spec.num_kv_heads)
        slot = self.write_slot[layer, rows]  # [B, Hkv]
        kc, vc = self.keys[layer], self.values[layer]
        kc[r, heads, slot] = key[:, :, 0]
        vc[r, heads, slot] = value[:, :, 0]
        self.scores[layer, r, heads, slot] = 0.0
        self.positions[layer, r, heads, slot] = step.start[:, None].to(self.device)
        used = int(self.region[rows].max()) + 1
        visible = select_rows(self.positions[layer], rows)[:, :, :used] >= 0  # [B, Hkv, used]: per-head kept sets
        out, probs = matrix_attention(query, select_rows(kc, rows)[:, :, :used], select_rows(vc, rows)[:, :, :used],
                                      visible[:, :, None, None, :], self.scale)
        with self.timers.section("cache_ops"):
            self.scores[layer, rows, :, :used] += probs.sum(dim=(2, 3))  # no head_dim axis: a cheap copy
        return out

    def after_pass(self, step: Step):
        if step.phase == "prefill":
            self.seen[step.rows] = step.start + step.q_len
            if step.last_chunk:
                with self.timers.section("cache_ops"):
                    self._compact(int(step.rows[0]))
        else:
            with self.timers.section("cache_ops"):
                self._evict_after_decode(step.rows)
        self._book()

    def _evict_after_decode(self, rows: torch.Tensor):
        """Each (layer, row, head) drops its lowest-scored token outside the recent window once over budget."""
        self.region[rows] = torch.maximum(self.region[rows], self.write_slot[0, rows, 0] + 1)
        self.kept[rows] += 1
        self.seen[rows] += 1
        allowed = torch.tensor([self.allowed(int(n)) for n in self.seen[rows]])
        over = rows[self.kept[rows] > allowed]
        under = rows[self.kept[rows] <= allowed]
        self.write_slot[:, under] = self.region[under][None, :, None]  # the budget grew: take a fresh slot
        if len(over) == 0:
            return
        recent = torch.tensor([self.split(int(k))[1] for k in allowed[self.kept[rows] > allowed]])
        window_start = (self.seen[over] - recent)[None, :, None, None].to(self.device)
        pos = self.positions[:, over]
        evictable = (pos >= 0) & (pos < window_start)
        victim = self.scores[:, over].masked_fill(~evictable, float("inf")).argmin(dim=-1)  # [L, B, Hkv]
        self.positions[:, over] = pos.scatter(-1, victim[..., None], -1)
        self.write_slot[:, over] = victim.cpu()
        self.kept[over] -= 1

    def _book(self):
        prompt = sum(held[0][0].shape[1] for held in self.prefill_kv.values() if held[0] is not None)
        kept = int(self.kept.sum())
        self.ledger.set("device", "h2o prompt cache", kv=(kept + prompt) * self.spec.kv_bytes_per_token,
                        kv_reserved=self.spec.kv_bytes(self.keys.shape[1] * self.cap - kept))

    def finish(self):
        self.keys = self.values = self.scores = self.positions = None
        self.prefill_kv = {}
        self.ledger.set("device", kv=0, kv_reserved=0, overhead=0)

    def cached_tokens(self):
        return self.kept.tolist()

    def kept_positions(self, layer: int, row: int) -> list[set[int]]:
        """Original token positions each KV head of a row keeps (for tests and the book's overlap figures)."""
        return [set(p[p >= 0].tolist()) for p in self.positions[layer, row]]


def select_heavy_recent(scores: torch.Tensor, heavy: int, recent: int) -> torch.Tensor:
    """Per head, the last `recent` positions and the `heavy` best-scored earlier ones, sorted. scores: [H, L]."""
    length = scores.shape[1]
    older = length - recent
    tail = torch.arange(older, length, device=scores.device).expand(scores.shape[0], -1)
    if heavy == 0:
        return tail
    top = scores[:, :older].topk(heavy, dim=1).indices
    return torch.cat([top.sort(dim=1).values, tail], dim=1)

