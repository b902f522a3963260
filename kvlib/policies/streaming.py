"""StreamingLLM (Xiao et al., ICLR 2024): attention sinks plus a recent window; everything between is evicted for good.

A row keeps its first `sink` tokens (the "attention sinks" that softmax parks its mass on) and the most recent tokens,
`tokens_allowed(seen)` in all (the one budget rule of kvlib.policies.base): after a prompt is prefilled the middle of
it is dropped, and at each decode step the oldest non-sink token leaves once the row is over budget. The storage,
compaction and freeing are the scored-eviction mechanism's, with a token's score its position (sinks: infinity), so
"evict the lowest score outside the recent window" is "evict the oldest non-sink".

Positions (`position_scheme`):
- `original` (the default, and what the experiments use): keys keep the rotary position of the token in the text, as
  every other kvlib policy does; a query at position p sees sinks at 0..3 and a window just before p. This compares
  policies on what they keep, not on a position trick, and stays within the model's context as the engine requires.
- `cache`: the paper's positions within the cache. The official code (mit-han-lab/streaming-llm,
  `pos_shift/modify_llama.py`) caches keys before RoPE and rotates them by their slot in the cache at every step, the
  query by its own slot (the cache length). kvlib's attention receives keys already rotated at their text position p,
  and RoPE rotations compose, so each kept key is rotated by (rank - p), its rank among the row's kept tokens in
  position order, and the query likewise: the same vectors as the official code's, without storing a second copy of
  the keys. This is what lets the model run past its context; the engine still refuses prompt + output longer than
  the context (its validation is shared by all policies), so here the scheme changes the positions the model sees,
  not how far it can go.

Read: mit-han-lab/streaming-llm `streaming_llm/kv_cache.py` (StartRecentKVCache: start_size=4 sinks, recent_size,
evict_for_space before each forward), `pos_shift/modify_llama.py`. Deviations:
- The budget is kvlib's (a share of the tokens seen, or `budget_tokens` = sinks + window) rather than a fixed
  start_size + recent_size, so StreamingLLM is compared with H2O and SnapKV at equal token counts; `budget_tokens`
  gives the official fixed-size cache.
- The official code evicts before a forward pass, so a prompt longer than the cache is processed in full and trimmed
  afterwards only when the next input comes; here the prompt is trimmed right after its prefill, the same point as
  every other eviction policy in kvlib (the prompt's own attention is the same: it sees the whole prompt).
- Re-rotation uses the model's `rotary_emb.inv_freq` (Llama-family RoPE, rotate-half layout); its attention_scaling
  multiplies both cos and sin of a rotation and cancels in a relative rotation, so it is left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlib.errors import UserError
from kvlib.kernels.decode import DecodeReads
from kvlib.policies.fidelity import Fidelity, Rule, Source
from kvlib.policies.registry import register
from kvlib.policies.scored_eviction import ScoredEvictionPolicy

POSITION_SCHEMES = ("original", "cache")


def rotate(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate rotary-embedded vectors x [..., D] by `delta` positions (broadcastable to x[..., 0])."""
    angles = delta[..., None].to(inv_freq.dtype) * inv_freq  # [..., D/2]
    angles = torch.cat([angles, angles], dim=-1)
    half = x.shape[-1] // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * angles.cos().to(x.dtype) + rotated_half * angles.sin().to(x.dtype)).to(x.dtype)


@register
@dataclass
class StreamingPolicy(ScoredEvictionPolicy):
    name = "streaming"
    small_example: ClassVar[dict] = {"budget": 0.3, "sink": 4}
    keeps_all_example: ClassVar[dict] = {"budget": 1.0, "sink": 4}
    allocations = ("uniform",)  # sinks and a window: no scored choice for an allocation to move between heads
    adopts_prefill = True
    evicts = "all but the first tokens (sinks) and a recent window, for good"

    sink: int = 4  # attention sinks kept at the start (the official start_size)
    position_scheme: str = "original"

    fidelity = Fidelity(Source("mit-han-lab/streaming-llm", "2e5042606d69933d88fbf909bd77907456b9b4dd",
                               "streaming_llm/kv_cache.py, streaming_llm/enable_streaming_llm.py, "
                               "examples/eval_long_ppl.py"), rules=(
        Rule("attention sinks", 4, setting="sink"),
        Rule("budget", "start_size + recent_size tokens, fixed", kvlib="budget x tokens seen (budget_tokens: fixed)",
             differs="a share of the tokens seen, kvlib's one budget rule; budget_tokens = sink + window is the "
                     "official fixed cache"),
        Rule("what is kept", "the first sinks and the most recent tokens",
             kvlib="the first sinks and the most recent tokens"),
        Rule("decode attends", "the kept tokens and the new one", kvlib="the kept tokens and the new one"),
        Rule("when it cuts", "after each token (eval_long_ppl)", kvlib="after the prefill and each decode step",
             differs="the prompt is prefilled densely, then cut, as every eviction policy here; the chat demo cuts "
                     "only between turns"),
        Rule("positions", "cache", setting="position_scheme",
             differs="the text's positions, as every other policy here keeps them: the book compares what is kept; "
                     "no run goes past the context, the reason for the official shift"),
    ), note="enable_streaming_llm applies the position shift on Llama models; eval_long_ppl cuts the cache after "
            "every token")

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.sink, int) or self.sink < 0:
            raise UserError(f"sink must be an integer >= 0, got {self.sink!r}")
        if self.position_scheme not in POSITION_SCHEMES:
            raise UserError(f"position_scheme must be one of {list(POSITION_SCHEMES)}, got {self.position_scheme!r}")
        if self.budget_tokens is not None and self.budget_tokens <= self.sink:
            raise UserError(f"budget_tokens={self.budget_tokens} leaves no recent window after sink={self.sink}; "
                            "it must exceed sink")

    def bind(self, model, ledger, timers):
        super().bind(model, ledger, timers)
        self.inv_freq = None
        if self.position_scheme == "cache":
            rotary = getattr(getattr(model.model, "model", None), "rotary_emb", None)
            if rotary is None or not hasattr(rotary, "inv_freq"):
                raise UserError("position_scheme='cache' needs a model with rotary embeddings (model.rotary_emb."
                                f"inv_freq); {type(model.model).__name__} has none")
            self.inv_freq = rotary.inv_freq.detach().float().to(self.device)

    def limits(self, seen, prompt):
        keep = self.tokens_allowed(seen)
        return keep, max(keep - self.sink, 0)

    def initial_scores(self, positions):
        return torch.where(positions < self.sink, float("inf"), positions.float())

    def prefill_arithmetic(self, mode, passes):
        """`cache` positions re-rotate what a later chunk attends: one pass only."""
        return super().prefill_arithmetic(mode, passes) if self.position_scheme == "original" or passes == 1 else None

    def prefill_attention_of(self, layer, query, keys, values, scores, begin, filled, step):
        if self.inv_freq is not None and filled:
            # the row holds the kept entries in position order, then the chunk: slot i has rank i in the cache
            pos = self.prompt_positions(layer, keys.shape[1])
            slots = torch.arange(keys.shape[1], device=self.device)
            keys = rotate(keys, slots - pos, self.inv_freq)
            query = rotate(query, torch.tensor(filled - begin, device=self.device), self.inv_freq)
        return super().prefill_attention_of(layer, query, keys, values, scores, begin, filled, step)

    def decode_reads(self, layer, query, rows, lengths):
        query, reads = super().decode_reads(layer, query, rows, lengths)
        if self.inv_freq is None:
            return query, reads
        used = int(lengths.max())
        slots = self.read_slots[:, None, :used]  # [B, 1, used]
        heads = torch.arange(self.spec.num_kv_heads, device=self.device)[None, :, None]
        keys, values = reads.keys[heads, slots], reads.values[heads, slots]  # copies: these keys are re-rotated
        inside = (torch.arange(used)[None, :] < lengths[:, None]).to(self.device)[:, None]  # past a row: stale slots
        positions = self.positions[layer][heads, slots].masked_fill(~inside, -1)  # [B, Hkv, used]
        valid = positions >= 0
        order = positions.masked_fill(~valid, torch.iinfo(positions.dtype).max).argsort(dim=-1)
        rank = order.argsort(dim=-1)  # [B, Hkv, used]: 0.. in position order; empty slots rank last
        newest = positions.max(dim=-1).values[:, 0]  # the query's own token, stored before attention
        query_delta = valid[:, 0].sum(dim=-1) - 1 - newest  # [B]
        keys = rotate(keys, rank - positions, self.inv_freq).contiguous()
        own_rows = torch.arange(len(rows))
        return rotate(query, query_delta[:, None, None], self.inv_freq), DecodeReads(keys, values, lengths,
                                                                                     rows=own_rows, probs=reads.probs)

    def stats(self):
        return {"sink": self.sink, "position_scheme": self.position_scheme}
