"""FlexGen + H2O: H2O's eviction in FlexGen's placed, layer-streamed cache (kvlib.policies.flexgen), by default as
the H2O authors' FlexGen port runs it (FMInference/H2O h2o_flexgen, `--hh-all`).

The budget is the port's by default (`budget_rule="flexgen"`): hh_k = int(budget x prompt) (or `budget_tokens`),
fixed during decode; hh_k = 0 is refused, as the port asserts it positive. `budget_rule="seen"` is H2O's budget of
kvlib's `h2o` instead (round(budget x tokens seen), split by `recent_ratio`), so that a budget means what it means for
the accuracy chapter's other policies (the share of the entries kept). Each entry's score is the attention it has
received, accumulated (the prompt's queries, then every decode step's); each slot's score and original position are
kept beside its key and value, on the same tier (as the port keeps its `acc` beside the cache), so a row's whole state
streams with it. What a row keeps (`eviction`):
- `port` (default), the port's rule: a pass reads 2 hh_k slots, hh_k heavy hitters, the hh_k - 1 newest entries and
  the new token. The prompt keeps the hh_k best-scored of its entries older than its last hh_k - 1, and those; at
  every decode step the lowest-scored heavy hitter is evicted and the entry leaving the recent window joins the heavy
  ones, whatever its score (the port moves it into the freed slot; here the next token takes that slot, the same
  entries in another order). Under `budget_rule="seen"` the slots a pass reads (its new token's included) are the
  budget, and the recent window counts the new token.
- `h2o`, kvlib's `h2o` rule: a row keeps 2 hh_k entries after every step (hh_k heavy, the hh_k newest) and reads the
  new token beside them (2 hh_k + 1); the lowest-scored entry older than the window is evicted. Uncompressed it decodes
  `h2o`'s tokens (budget_rule either, prefill "full"; tests/policies/test_flexgen.py) on any placement.

A row holds at most its kept set plus the new token (the prompt is scored from the pass's own keys and values, then
only the kept entries are stored), which is what makes the cache small enough to place. Beyond the port, whose disk
and 4-bit devices take no H2O cache (their `init_cache_one_gpu_batch` has no hh_k: it fails there), the cache here may
be compressed and on disk; FlexGen itself (FMInference/FlexLLMGen) has no H2O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlib.errors import UserError
from kvlib.kernels.attention import causal_mask, matrix_attention, matrix_bytes
from kvlib.kernels.decode import DecodeReads
from kvlib.memory.tiered_kv import CacheArray
from kvlib.policies.allocation import select_heavy_recent
from kvlib.policies.base import Step
from kvlib.policies.fidelity import Fidelity, Rule, Source
from kvlib.policies.flexgen import FlexGenPolicy
from kvlib.policies.h2o import BUDGET_RULES, HeavyHitterPolicy, heavy_recent
from kvlib.policies.registry import register

EVICTIONS = ("port", "h2o")
PORT = Source("FMInference/H2O", "ac75c2a", "h2o_flexgen/flexgen/flex_opt.py, pytorch_backend.py")


@register
@dataclass
class FlexGenH2OPolicy(FlexGenPolicy):
    name = "flexgen_h2o"
    small_example: ClassVar[dict] = {"budget": 0.3, "percent": "100 0 40 60 100 0"}
    keeps_all_example: ClassVar[dict] = {"budget": 1.0, "percent": "100 0 40 60 100 0"}
    label = "flexgen+h2o"
    lossless = False
    supported_prefill = ("full",)  # the prompt's attention probabilities score it, in one pass
    preferred_prefill: ClassVar[str] = "full"
    keeps, evicts = HeavyHitterPolicy.keeps, HeavyHitterPolicy.evicts  # H2O's rule, in FlexGen's cache
    adopts_prefill = True  # one dense pass, its attention matrix the scores: a recorded one's keys, values and scores

    budget: float = 0.3  # the heavy-hitter ratio: heavy = recent = int(budget x prompt) (budget_rule flexgen)
    budget_tokens: int | None = None
    budget_rule: str = "flexgen"
    recent_ratio: float = 0.5  # budget_rule seen: the recent window's share of what a row keeps
    eviction: str = "port"  # the port's slots and eviction, or "h2o": kvlib's h2o's (the module's docstring)

    fidelity = Fidelity(PORT, rules=(
        Rule("budget rule", "flexgen", setting="budget_rule"),
        Rule("hh_k = int(ratio x prompt) = 0", "refused", kvlib="refused"),
        Rule("slots and eviction", "port", setting="eviction"),
        Rule("slots a pass reads", "2 hh_k: hh_k heavy, hh_k - 1 recent, the new token",
             kvlib="2 hh_k: hh_k heavy, hh_k - 1 recent, the new token"),
        Rule("evicted at each decode step", "lowest accumulated score among the hh_k heavy slots",
             kvlib="lowest accumulated score among the hh_k heavy slots"),
        Rule("the entry leaving the window", "moved into the freed heavy slot",
             kvlib="joins the heavy ones where it is; the next token takes the freed slot",
             differs="the same entries and scores, summed by attention in another order; no copy of an entry a step"),
        Rule("prompt", "hh_k best of all but the last hh_k - 1, and those",
             kvlib="hh_k best of all but the last hh_k - 1, and those"),
        Rule("score", "attention received, summed over queries, per head (OPT: MHA)",
             kvlib="attention received, summed over queries and a GQA group's query heads",
             differs="one score per stored KV head; the same as the port's on an MHA model"),
        Rule("score precision", "fp16", kvlib="fp32", differs="sums of many probabilities round in fp16"),
        Rule("hh_k = 1", "fails (top-k of an empty range, % 0)", kvlib="1 heavy slot, the new token",
             differs="the port's rule at its limit"),
        Rule("4-bit cache, cache on disk", "fails (no hh_k in those devices' cache)", kvlib="allowed",
             differs="kvlib's extension: the H2O cache compressed or on disk"),
    ), note="H2O's authors' port of H2O into FlexGen (run with --hh-all); FlexGen itself has no H2O")

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.budget <= 1:
            raise UserError(f"budget must be in (0, 1], got {self.budget}")
        if self.budget_tokens is not None and self.budget_tokens < 1:
            raise UserError(f"budget_tokens must be >= 1, got {self.budget_tokens}")
        if self.budget_rule not in BUDGET_RULES:
            raise UserError(f"budget_rule must be one of {list(BUDGET_RULES)}, got {self.budget_rule!r}")
        if not 0 <= self.recent_ratio <= 1:
            raise UserError(f"recent_ratio must be in [0, 1], got {self.recent_ratio}")
        if self.eviction not in EVICTIONS:
            raise UserError(f"eviction must be one of {list(EVICTIONS)}, got {self.eviction!r}")

    def limits(self, seen: int, prompt: int) -> tuple[int, int]:
        """(tokens kept, of which recent) per KV head: H2O's budget rules."""
        return heavy_recent(self.budget_rule, self.budget, self.budget_tokens, self.recent_ratio, seen, prompt)

    def held(self, seen: int, prompt: int) -> tuple[int, int]:
        """(entries a row holds between passes once it has seen `seen` tokens, of which the newest are the recent
        window's). The port's budget is the slots the next pass reads, its new token's included."""
        if self.eviction == "h2o":
            return self.limits(seen, prompt)
        keep, recent = self.limits(seen + 1, prompt)
        return keep - 1, max(recent, 1) - 1

    def window(self, seen: int, prompt: int) -> int:
        """The recent window of a decode pass that has seen `seen` tokens, its new token's included: never evicted."""
        recent = self.limits(seen, prompt)[1]
        return recent if self.eviction == "h2o" else max(recent, 1)

    def check_heavy(self, prompt: int) -> None:
        """The port asserts hh_k > 0 (flex_opt.py's main); a budget that keeps no heavy hitter is refused here too."""
        keep, recent = self.held(prompt, prompt)
        if (keep if self.eviction == "h2o" else keep - recent) < 1:
            raise UserError(f"policy {self.name!r}: budget {self.budget} (budget_rule {self.budget_rule!r}) keeps no "
                            f"heavy hitter of a {prompt}-token prompt (hh_k = 0), which the FlexGen + H2O port "
                            "refuses; raise the budget or set budget_tokens")

    def cache_arrays(self) -> list[CacheArray]:
        return [*super().cache_arrays(), CacheArray("scores", (), torch.float32, 0.0),
                CacheArray("positions", (), torch.long, -1)]

    def cache_capacity(self, prompt_lens, max_new_tokens):
        # the kept set at its largest, plus the new token stored before the step's eviction frees a slot
        return max(self.held(n + max_new_tokens, n)[0] + 1 for n in prompt_lens)

    def init_rows(self, rows):
        s = self.spec
        self.kept = torch.zeros(rows, dtype=torch.long)  # entries a row keeps (per head, every layer)
        self.region = torch.zeros(rows, dtype=torch.long)  # slots a row has used, a hole included
        self.seen = torch.zeros(rows, dtype=torch.long)
        self.prompt_of = torch.zeros(rows, dtype=torch.long)
        self.write_slot = torch.zeros((s.num_layers, rows, s.num_kv_heads), dtype=torch.long)

    # -- prefill -----------------------------------------------------------------------------------------------------
    def prepare(self, step: Step):
        rows = step.rows
        if step.phase == "prefill":
            row = int(rows[0])
            if int(step.start[0]) != 0 or int(self.region[row]):
                raise UserError(f"policy {self.name!r} prefills a row once (row {row} already holds tokens)")
            self.check_heavy(step.q_len)
            if min(self.held(step.q_len, step.q_len)[0], step.q_len) > self.capacity:
                raise UserError(f"a prompt of {step.q_len} tokens keeps more than the rows hold ({self.capacity})")
            self.begin_pass(step, torch.zeros(1, dtype=torch.long))
            return
        # decode: the pass-wide decisions of the eviction (the same for every layer and head)
        self.read_lengths = torch.maximum(self.region[rows], self.write_slot[0, rows, 0] + 1)
        self.begin_pass(step, self.read_lengths)
        self.region_after = self.read_lengths.clone()
        self.seen_after = self.seen[rows] + 1
        seen = [(int(n), int(p)) for n, p in zip(self.seen_after, self.prompt_of[rows])]
        self.over = (self.kept[rows] + 1) > torch.tensor([self.held(n, p)[0] for n, p in seen])
        self.window_start = self.seen_after - torch.tensor([self.window(n, p) for n, p in seen])

    def attend(self, layer, query, key, value, step: Step):
        if step.phase == "prefill":
            return self._prefill(layer, query, key, value, step)
        return self._decode(layer, query, key, value, step)

    def _prefill(self, layer, query, key, value, step):
        t = step.q_len
        nbytes = matrix_bytes(1, self.spec.num_attention_heads, t, t, self.spec.dtype_bytes)
        with self.ledger.transient("device", "activations", nbytes, where=f"attention matrix, layer {layer}"):
            out, probs = matrix_attention(query, key, value, causal_mask(t, t, self.device), self.scale)
            self._keep_prompt(layer, key, value, probs[0].sum(dim=(1, 2)), step)
        return out

    def adopt_pass(self, layer, recorded, step: Step):
        self._keep_prompt(layer, recorded.key(layer), recorded.value(layer), recorded.received(layer), step)

    def _keep_prompt(self, layer, key, value, received, step):
        """Store what the prompt keeps of key, value [1, Hkv, t, D], scored by the attention each entry received
        [Hkv, t] (summed over the queries and each group's query heads)."""
        arrays, places, group = self.layer_arrays(layer, step)
        row, at, t = int(step.rows[0]), int(places[0]), step.q_len
        with self.timers.section("eviction"):
            scores = received.float()
            keep, recent = self.held(t, t)
            keep = min(keep, t)
            idx = select_heavy_recent(scores, keep - min(recent, keep), min(recent, keep))  # [Hkv, keep]
            d = self.spec.head_dim
            arrays["keys"][at, :, :keep] = key[0].gather(1, idx[..., None].expand(-1, -1, d))
            arrays["values"][at, :, :keep] = value[0].gather(1, idx[..., None].expand(-1, -1, d))
            arrays["scores"][at, :, :keep] = scores.gather(1, idx)
            arrays["positions"][at, :, :keep] = idx
            self.store.store_range(layer, group, list(arrays), 0, keep, (at, at + 1))
            self.write_slot[layer, row] = keep

    # -- decode ------------------------------------------------------------------------------------------------------
    def _decode(self, layer, query, key, value, step):
        arrays, at, group = self.layer_arrays(layer, step)
        rows, h, reads = step.rows, self.spec.num_kv_heads, step.own(self.read_lengths)
        dev_rows = at.to(self.device)
        heads = torch.arange(h, device=self.device)[None, :]
        slot = self.write_slot[layer, rows].to(self.device)  # [B, Hkv]
        kc, vc, scores, positions = (arrays[n] for n in ("keys", "values", "scores", "positions"))
        kc[dev_rows[:, None], heads, slot] = key[:, :, 0]
        vc[dev_rows[:, None], heads, slot] = value[:, :, 0]
        scores[dev_rows[:, None], heads, slot] = 0.0
        positions[dev_rows[:, None], heads, slot] = step.start[:, None].to(self.device).expand(-1, h)
        out, probs = self.decode_attention(layer, query, DecodeReads(kc, vc, reads, rows=at, probs=True))
        used = int(reads.max())
        with self.timers.section("eviction"):
            scores[dev_rows, :, :used] += probs[..., :used].to(scores.dtype)
            victims = self._evict(layer, step, at, scores, positions, used)
        self.store.store_points(layer, group, ("keys", "values", "positions"), self.flats(at), slot.reshape(-1).cpu())
        if victims is not None:
            self.store.store_points(layer, group, ("positions",), *victims)
        self._store_scores(layer, group, at, reads)
        attended = int(self.kept[rows].sum()) + len(rows)
        self.usage.add(layer, attended, step.tokens_seen, len(rows))
        return out

    def _evict(self, layer, step, at, scores, positions, used):
        """This layer's part of the eviction: each over-budget (row, head) drops its lowest-scored entry older than the
        recent window (the port's heavy slots, or every older entry under `h2o`'s larger kept set), and the next token
        takes its slot; the others take a fresh slot. at: the step's rows' places in the unit's arrays."""
        rows, is_over, region_after = step.rows, step.own(self.over), step.own(self.region_after)
        over, under = rows[is_over], rows[~is_over]
        self.write_slot[layer, under] = region_after[~is_over][:, None]
        if len(over) == 0:
            return None
        dev_over = at[is_over].to(self.device)
        pos = positions[dev_over, :, :used]  # [B', Hkv, used]
        inside = (torch.arange(used)[None, :] < region_after[is_over][:, None]).to(self.device)[:, None]
        window = step.own(self.window_start)[is_over][:, None, None].to(self.device)
        evictable = inside & (pos >= 0) & (pos < window)
        victim = scores[dev_over, :, :used].masked_fill(~evictable, float("inf")).argmin(dim=-1)  # [B', Hkv]
        heads = torch.arange(self.spec.num_kv_heads, device=self.device)[None, :]
        positions[dev_over[:, None], heads, victim] = -1
        self.write_slot[layer, over] = victim.cpu()
        return self.flats(at[is_over]), victim.reshape(-1).cpu()

    def _store_scores(self, layer, group, at, reads):
        """Every read slot's score changed: back to the tiers, one run of tokens for the group's rows where all of
        them stepped."""
        if len(at) == self.store.groups[group].rows:  # (a pass's rows are distinct)
            self.store.store_range(layer, group, ("scores",), 0, int(reads.max()))
            return
        for r, n in zip(at.tolist(), reads.tolist()):
            self.store.store_range(layer, group, ("scores",), 0, n, (r, r + 1))

    def after_pass(self, step: Step):
        rows = step.rows
        if step.phase == "prefill":
            row = int(rows[0])
            keep = int(self.write_slot[0, row, 0])
            self.seen[row] = self.prompt_of[row] = step.q_len
            self.kept[row] = self.region[row] = keep
        else:
            self.region[rows] = self.region_after
            self.kept[rows] += 1 - self.over.long()
            self.seen[rows] = self.seen_after
        self.settle()
        self._book()

    def fork(self, src, dst):
        self.copy_row(src, dst, int(self.region[src]))
        for per_row in (self.kept, self.region, self.seen, self.prompt_of):
            per_row[dst] = per_row[src]
        self.write_slot[:, dst] = self.write_slot[:, src]
        self._book()

    def release(self, row):
        for per_row in (self.kept, self.region, self.seen, self.prompt_of):
            per_row[row] = 0
        self.write_slot[:, row] = 0
        self._book()

    def tokens_per_flat(self) -> torch.Tensor:
        return self.kept.repeat_interleave(self.spec.num_kv_heads)
