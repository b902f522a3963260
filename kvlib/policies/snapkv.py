"""SnapKV (Li et al., 2024): at the end of a prompt, its last queries vote for the prefix entries each head keeps.

When a row's prompt is in, the queries of its last `window` tokens (the observation window) attend over the whole
buffer; the attention each earlier entry receives is summed over the window's queries, averaged over the query heads
of a KV head's group, smoothed along the sequence with a 1-D pooling of `kernel_size` (`pooling`: avgpool or maxpool,
stride 1, padding kernel_size // 2, so a token next to a voted one comes along), and the best-scored entries are kept
together with the window itself: `tokens_allowed(prompt)` per KV head in all (the one budget rule of
kvlib.policies.base), of which the window. Decode appends every new token and evicts nothing, so a row holds its
compressed prompt plus its output. Storage, compaction and freeing are the scored-eviction mechanism's.

Read: FasterDecoding/SnapKV `snapkv/monkeypatch/snapkv_utils.py` (SnapKVCluster.update_kv: window_size,
max_capacity_prompt, kernel_size, pooling; init_snapkv's defaults 32, 5, avgpool, which kvlib keeps; the repository's
LongBench ablation configs run 32, 7, maxpool; the causal mask within the window; `attn_weights[..., -window:,
:-window].sum(-2)`, pooling, topk of max_capacity_prompt - window_size, the window concatenated after) and
NVIDIA/kvpress's snapkv_press.py for the scorer / mechanism split. Deviations (the `fidelity` entry's rows):
- Per KV head under GQA. The official code repeats K/V to every query head (`repeat_kv`) before selecting, so a
  KV head is stored kv_groups times, each copy with its own selection, and the cache is no smaller than the query heads
  make it. Here a KV head's votes are the mean of its group's query heads', pooled after (the order of FFY0/AdaKV's
  gqa_support and of KVCache-Factory's kv_head layout), and one copy is kept per KV head: the memory saving the method
  promises, at the cost of one selection shared by the group.
- The budget is kvlib's share of the prompt (or `budget_tokens`) instead of an absolute max_capacity_prompt; a prompt
  is still compressed when it is shorter than the window (the official code leaves prompts below max_capacity_prompt
  alone, which at a share < 1 is never), and a budget smaller than the window keeps the last `budget` tokens only.
- Chunked prefill: the window's queries are kept across chunks (booked as overhead while the prompt is being
  prefilled), so the votes are those of full prefill whatever the chunk size. The official code has no chunked prefill.
- A later turn of a conversation is compressed again at its end, its window voting over the entries kept of earlier
  turns and the new turn together; the official code compresses only the first prefill.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvlib.errors import UserError
from kvlib.kernels.attention import causal_mask, grouped_scores
from kvlib.policies.base import Step
from kvlib.policies.fidelity import Fidelity, Rule, Source
from kvlib.policies.registry import register
from kvlib.policies.scored_eviction import ScoredEvictionPolicy

POOLINGS = ("avgpool", "maxpool")


@register
@dataclass
class SnapKVPolicy(ScoredEvictionPolicy):
    name = "snapkv"
    small_example: ClassVar[dict] = {"budget": 0.3, "window": 8}  # AdaKV's and PyramidKV's as well
    keeps_all_example: ClassVar[dict] = {"budget": 1.0, "window": 8}
    adopts_prefill = True
    evicts = "at the end of prefill, what the last queries attend least, for good"

    window: int = 32  # observation window (the official default window_size)
    kernel_size: int = 5
    pooling: str = "avgpool"

    fidelity = Fidelity(Source("FasterDecoding/SnapKV", "e216ddc84c5bd210378cbdbbba12ba02102aa640",
                               "snapkv/monkeypatch/snapkv_utils.py"), rules=(
        Rule("budget", "max_capacity_prompt tokens a head, the window in it", kvlib="budget x prompt, the window in it",
             differs="a share of each prompt, kvlib's one budget rule (budget_tokens: absolute)"),
        Rule("observation window", 32, setting="window"),
        Rule("pooling kernel", 5, setting="kernel_size"),
        Rule("pooling", "avgpool", setting="pooling"),
        Rule("votes", "window queries' attention summed, causal in the window",
             kvlib="window queries' attention summed, causal in the window"),
        Rule("under GQA", "per query head (K/V repeated)", kvlib="per KV head: group mean, then pooled",
             differs="one copy per KV head, the memory GQA saves"),
        Rule("what is kept", "top votes, then the window", kvlib="top votes, then the window"),
        Rule("decode", "appends, evicts nothing", kvlib="appends, evicts nothing"),
        Rule("later turns", "first prefill only", kvlib="each turn's end",
             differs="a conversation's turns are prompts too"),
    ), note="init_snapkv's defaults (window 32, kernel 5, avgpool); the repository's LongBench ablation configs run "
            "kernel 7 with maxpool (`--set kernel_size=7 pooling=maxpool`).")

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.window, int) or self.window < 1:
            raise UserError(f"window must be an integer >= 1, got {self.window!r}")
        if not isinstance(self.kernel_size, int) or self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise UserError(f"kernel_size must be an odd integer >= 1 (pooling keeps the length), got "
                            f"{self.kernel_size!r}")
        if self.pooling not in POOLINGS:
            raise UserError(f"pooling must be one of {list(POOLINGS)}, got {self.pooling!r}")

    def limits(self, seen, prompt):
        kept_prompt = self.tokens_allowed(prompt)
        return kept_prompt + seen - prompt, min(self.window, kept_prompt)

    def start(self, batch_size, prompt_lens, max_new_tokens):
        super().start(batch_size, prompt_lens, max_new_tokens)
        self.window_queries: dict[int, torch.Tensor] = {}  # row -> [L, Hq, w, D]: its prompt's last queries
        self.window_filled: dict[int, int] = {}

    def prepare(self, step: Step):
        row = int(step.rows[0])
        if step.phase == "prefill" and row not in self.window_queries:
            s = self.spec
            w = min(self.window, int(step.end[0]) - int(step.start[0]))
            shape = (s.num_layers, s.num_attention_heads, w, s.head_dim)
            self.ledger.add("device", "overhead", math.prod(shape) * s.dtype_bytes, where="snapkv window queries")
            self.window_queries[row] = torch.zeros(shape, dtype=s.dtype, device=self.device)
            self.window_filled[row] = 0
        super().prepare(step)

    def prefill_attention_of(self, layer, query, keys, values, scores, begin, filled, step):
        out = super().prefill_attention_of(layer, query, keys, values, scores, begin, filled, step)
        row = int(step.rows[0])
        held, have = self.window_queries[row][layer], self.window_filled[row]
        w = held.shape[1]
        latest = torch.cat([held[:, :have], query[0]], dim=1)[:, -w:]
        held[:, :latest.shape[1]] = latest
        if step.last_chunk:
            with self.timers.section("eviction"):
                self._vote(layer, latest, keys, scores)
        return out

    def prefill_queries(self):
        return self.window

    def prefill_statistics(self, layer, recorded, keys, scores, step):
        """The votes of the prompt's last queries, at its last pass, as prefill_attention_of casts them."""
        if step.last_chunk:
            w = self.window_queries[int(step.rows[0])].shape[2]
            with self.timers.section("eviction"):
                self._vote(layer, recorded.queries(layer)[:, -w:], keys, scores)

    def _vote(self, layer: int, window_q: torch.Tensor, keys: torch.Tensor, scores: torch.Tensor):
        """scores[:, :-w] = the pooled votes of the window's queries [Hq, w, D] for the entries before the window."""
        w, end = window_q.shape[1], keys.shape[1]
        prefix = end - w
        if prefix <= 0:
            return
        s = self.spec
        nbytes = s.num_attention_heads * w * end * (s.dtype_bytes + 4)
        with self.ledger.transient("device", "activations", nbytes, where=f"snapkv votes, layer {layer}"):
            logits = grouped_scores(window_q[None], keys[None], self.scale)[0]  # [Hkv, G, w, end]
            logits = logits.masked_fill(~causal_mask(w, end, self.device), float("-inf"))
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            # the group's mean, then pooled: the order of FFY0's gqa_support and KVCache-Factory's kv_head layout
            votes = probs[..., :prefix].sum(dim=-2).mean(dim=1)  # [Hkv, prefix]
            pool = F.avg_pool1d if self.pooling == "avgpool" else F.max_pool1d
            scores[:, :prefix] = pool(votes[:, None], kernel_size=self.kernel_size, padding=self.kernel_size // 2,
                                      stride=1)[:, 0]

    def after_pass(self, step: Step):
        if step.phase == "prefill":
            row = int(step.rows[0])
            if step.last_chunk:  # the votes are cast: the window's queries go before the pass is booked
                self.window_queries.pop(row)
                self.window_filled.pop(row)
            else:
                self.window_filled[row] = min(self.window_queries[row].shape[2], self.window_filled[row] + step.q_len)
        super().after_pass(step)

    def extra_overhead(self):
        return sum(q.nbytes for q in self.window_queries.values())

    def finish(self):
        self.window_queries, self.window_filled = {}, {}
        super().finish()
