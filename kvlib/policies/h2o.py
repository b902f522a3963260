"""H2O (Zhang et al., 2023): keep the heavy hitters and a recent window, evict the rest for good.

As the H2O authors' real-eviction cache does (FMInference/H2O h2o_hf/utils_real_drop, `H2OKVCache_LayerWise`): each
cached token accumulates the attention it receives from every later query, the prompt's included; after a prompt is
prefilled, and after every decode step, a row keeps the `recent` newest tokens (the new one included) plus the `heavy`
tokens with the highest accumulated score among the others; the evicted entries are dropped and their memory is
released. There the scores are per attention head (an MHA model: its cache cannot drop a GQA cache) and summed over
the batch (run at batch 1); here per KV head, the query heads of a GQA group summed, and per row. What the budget
means (`budget_rule`, tokens kept per KV head):
- `seen` (default, kvlib's): heavy + recent = round(budget x tokens seen so far), split by `recent_ratio`; it grows
  with the generated tokens, so budget 1.0 keeps everything. `budget_tokens` fixes the total instead.
- `flexgen`: the budget the H2O authors' experiments set from the prompt (h2o_hf's heavy_ratio and recent_ratio, and
  the FlexGen port's hh_ratio, "heavy-hitter ratio 0.3" in the paper's runs): heavy = recent = int(budget x prompt length)
  (or `budget_tokens` each), fixed during decode, so ratio 0.3 keeps ~60 % of the prompt. Under it `h2o` keeps 2 hh_k
  entries and reads the new token beside them; the FlexGen port keeps one fewer (hh_k - 1 recent): that rule is
  `flexgen_h2o`'s (eviction "port"), not this one.

Prefill needs attention probabilities, so it runs with a materialized attention matrix: `full` builds the L x L matrix
(the memory wall the paper hits), `chunked` builds C x L per chunk. With `chunk_scoring="accumulate"` every chunk's
queries score all earlier tokens, so the kept set equals full prefill's (the fix the paper proposes); the prompt's KV is
held until its last chunk in a buffer sized for the whole prompt at its first chunk (booked then, so a prompt that does
not fit fails before any compute), which bounds the matrix, not the KV. `chunk_scoring="per_chunk"` is the variant the
paper measured: a token is scored only by queries of its own chunk. `fused` prefill computes no probabilities: refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlib.errors import UserError
from kvlib.kernels.attention import causal_mask, matrix_attention, matrix_bytes
from kvlib.policies import h2o_one_pass
from kvlib.policies.base import tokens_allowed
from kvlib.policies.fidelity import Fidelity, Rule, Source
from kvlib.policies.registry import register
from kvlib.policies.scored_eviction import ScoredEvictionPolicy

CHUNK_SCORING = ("accumulate", "per_chunk")
BUDGET_RULES = ("seen", "flexgen")


def heavy_recent(rule: str, budget: float, budget_tokens: int | None, recent_ratio: float, seen: int,
                 prompt: int) -> tuple[int, int]:
    """(tokens kept, of which recent) per KV head under a budget rule (the module's): H2O's, and FlexGen + H2O's."""
    if rule == "flexgen":
        part = budget_tokens if budget_tokens is not None else int(budget * prompt)
        return min(2 * part, seen), min(part, seen)
    keep = tokens_allowed(budget, budget_tokens, seen)
    return keep, round(keep * recent_ratio)


@register
@dataclass
class HeavyHitterPolicy(ScoredEvictionPolicy):
    """The scoring of H2O (attention received, accumulated) and its recent window; storage and eviction are the
    shared mechanism's (kvlib.policies.scored_eviction)."""

    name = "h2o"
    supported_prefill = ("full", "chunked")
    preferred_prefill = "chunked"  # with cross-chunk accumulation: full prefill's kept set without its L x L matrix
    decode_scores = True
    adopts_prefill = True
    evicts = "the least accumulated attention outside a recent window, for good"

    one_pass_source = "FMInference/H2O@1603343 h2o_hf/utils_lm_eval/modify_llama.py"

    recent_ratio: float = 0.5  # share of the budget given to the recent window (the H2O paper splits it evenly)
    chunk_scoring: str = "accumulate"
    budget_rule: str = "seen"

    fidelity = Fidelity(Source("FMInference/H2O", "ac75c2a", "h2o_hf/utils_real_drop/modify_llama.py, "
                                                         "utils_hh/modify_llama.py"), rules=(
        Rule("budget rule", "flexgen", setting="budget_rule",
             differs="a share of the tokens seen, as every budgeted policy here counts its budget; `flexgen` is "
                     "the official: heavy = recent, fixed, int(ratio x prompt) or a token count"),
        Rule("recent share of the budget", 0.5, setting="recent_ratio"),
        Rule("kept after each step", "top heavy by score older than the window, and the last recent",
             kvlib="top heavy by score older than the window, and the last recent"),
        Rule("recent window", "the newest tokens, the new one included",
             kvlib="the newest tokens, the new one included"),
        Rule("when it evicts", "after prefill and after every decode step",
             kvlib="after prefill and after every decode step"),
        Rule("score", "attention received, summed over queries, per attention head (MHA only)",
             kvlib="attention received, summed over queries and a GQA group's query heads",
             differs="one score per stored KV head, so a GQA cache can be dropped; the same on an MHA model"),
        Rule("batch", "scores summed over the batch (run at batch 1)", kvlib="per row",
             differs="a batch's rows are separate sequences"),
        Rule("prefill", "full: one L x L pass", kvlib="chunked (preferred; full is a mode)",
             differs="chunks bound the attention matrix's memory; under accumulate the scores are the same sums"),
        Rule("prompt scored by every later query", "accumulate", setting="chunk_scoring"),
        Rule("score precision", "the model's (fp16)", kvlib="fp32", differs="sums of many probabilities round in fp16"),
        Rule("accuracy harness (utils_lm_eval)", "one pass a request, each row masked: heavy - 1 hitters by "
             "accumulated attention, itself, and int(recent_ratio x T) before it; heavy = int(heavy_ratio x T)",
             kvlib="protocol one_pass: the same mask, per attention head, T the request's tokens",
             differs="the accuracy chapter also runs kvlib's deployed protocol (a dense prefill, then decode "
                     "steps through the cache), reported apart"),
    ), note="the authors' real-eviction cache (fixed token counts); their accuracy runs (utils_hh) simulate it "
             "with attention masks, the counts int(ratio x prompt)")

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

    def limits(self, seen: int, prompt: int) -> tuple[int, int]:
        return heavy_recent(self.budget_rule, self.budget, self.budget_tokens, self.recent_ratio, seen, prompt)

    def prefill_attention_of(self, layer, query, keys, values, scores, begin, filled, step):
        """A chunk's queries see what the row holds and, causally, the chunk itself; every held entry's score
        accumulates the attention it receives (summed over the group's query heads and the chunk's queries)."""
        t, end = step.q_len, keys.shape[1]
        nbytes = matrix_bytes(1, self.spec.num_attention_heads, t, end, self.spec.dtype_bytes)
        with self.ledger.transient("device", "activations", nbytes, where=f"attention matrix, layer {layer}"):
            out, probs = matrix_attention(query, keys[None], values[None], causal_mask(t, end, self.device),
                                          self.scale)
            self._fold(scores, probs[0].sum(dim=(1, 2)), t)
        return out

    def prefill_arithmetic(self, mode, passes):
        # its prefill materializes the matrix whatever the mode (fused is refused)
        return "matrix" if super().prefill_arithmetic(mode, passes) else None

    def prefill_statistics(self, layer, recorded, keys, scores, step):
        self._fold(scores, recorded.received(layer), step.q_len)

    def _fold(self, scores, received, t: int):
        """A prefill pass's attention received [Hkv, end] (summed over its queries and each group's query heads) into
        the row's scores [Hkv, end], under chunk_scoring."""
        with self.timers.section("eviction"):
            if self.chunk_scoring == "per_chunk":
                scores[:, -t:] += received[:, -t:]
            else:
                scores += received

    def one_pass_keep(self, layer, query, key, scores):
        """The harness's mask (kvlib.policies.h2o_one_pass): heavy and recent counted on the whole sequence under
        the budget rule (`flexgen`: heavy_ratio = recent_ratio = budget, as the harness's two ratios; `seen`: the
        budget in all, split by recent_ratio)."""
        t = scores.shape[-1]
        kept, recent = heavy_recent(self.budget_rule, self.budget, None, self.recent_ratio, t, t)
        return h2o_one_pass.keep_mask(scores, kept - recent, recent)

    def update_scores(self, layer, rows, probs):
        with self.timers.section("eviction"):
            self.tokens.add_scores(layer, probs)
