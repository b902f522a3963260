"""DuoAttention (Xiao et al., 2024): retrieval heads keep every entry, streaming heads keep attention sinks and a
recent window.

Which (layer, KV head) is which is decided from a calibration text, offline (kvlib.policies.duo_heads: the attention
mass a head would lose to the streaming pattern, ranked model-wide); the knob is the share of retrieval heads,
`retrieval_ratio`. Without one, `budget` is what it is for every other policy, the share of the KV entries a row
keeps, and sets the ratio at which the batch's prompts (their mean length n) keep that share once prefilled:
r x n + (1 - r) x c = budget x n, c = min(n, sink + window + 1) the entries a streaming head keeps (ratio
(budget x n - c) / (n - c), within [0, 1]). So a budget compares duo with H2O or SnapKV at equal KV bytes, and budget
1.0 is the full cache. Streaming heads keep what StreamingLLM keeps (kvlib.policies.streaming, at budget_tokens =
sink + window): the first `sink` tokens and the `window` most recent, so at ratio 0 this policy is StreamingLLM.

Storage, per layer: the retrieval heads' entries in a per-row cache [rows, R, capacity, D] (as `full` holds every
head's: each row reserves its longest length, and serving holds as many rows as the device capacity affords), the
streaming heads' in a per-row ring [rows, S, sink + window + 1, D]: a token at position p >= sink lies in slot sink +
(p - sink) mod (window + 1), so the newest token overwrites the one that leaves the window. So a streaming head holds
sink + window + 1 entries however long the row grows: the memory the method saves is held less, and booked so.

Prefill attends the whole prompt on every head (as StreamingLLM in kvlib does: its prompt is trimmed after its
prefill): while a row's prompt is prefilled, its streaming heads hold the prompt in full in a staging buffer (after
the sinks and window they kept of earlier turns), booked as KV while it lives; when its last chunk is in, the sinks
and the window go to the ring and the buffer is freed. Decode runs the one decode kernel (kvlib.kernels.decode) twice
a layer, over each kind of head's cache with the query heads of its groups: each call's rows read one length for
every head, the whole row for retrieval heads, the ring's filled slots for streaming heads (attention does not depend
on the order its entries lie in).

Read: mit-han-lab/duo-attention (`duo_attn/patch/llama.py`, the evaluation path: a prompt prefilled densely on every
head, then the streaming heads' cache cut to sink + recent, each decode step attending those and the new token;
`duo_attn/utils.py`: retrieval heads per (layer, KV head), the `sparsity` quantile of the gates model-wide, sink 64
and recent 256) and NVIDIA/kvpress's DuoAttentionPress. Deviations (each a row of the fidelity table): heads are chosen
by a training-free score, not the learned gates (see duo_heads); the knob is the budget, a share of the KV entries,
rather than the share of streaming heads; `sink` is StreamingLLM's 4, not the official 64, which with the official 256
recent tokens would keep most of the study's 512-token items on every streaming head (the profiles scale `window` to
their prompts too); a prompt is prefilled whole (the official LongBench runs feed its last 50 tokens as decode steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlib.errors import UserError
from kvlib.kernels.attention import prefill_attention
from kvlib.kernels.decode import DecodeReads
from kvlib.policies.base import BudgetedPolicy, Step
from kvlib.policies.duo_heads import choose_retrieval, head_scores, retrieval_count, stability
from kvlib.policies.fidelity import Fidelity, Rule, Source
from kvlib.policies.registry import register


@register
@dataclass
class DuoAttentionPolicy(BudgetedPolicy):
    name = "duo"
    small_example: ClassVar[dict] = {"budget": 0.5, "sink": 4, "window": 8}
    calibrates = True
    adopts_prefill = True  # every head attends the whole prompt densely: a recorded prefill's keys and values, stored
    keeps = "every entry on retrieval heads; sinks and a recent window on streaming heads"
    evicts = "on streaming heads, all but the sinks and a recent window, for good"

    budget: float = 0.5  # the share of the KV entries kept, when retrieval_ratio is not given (the module's mapping)
    retrieval_ratio: float | None = None  # share of (layer, KV head) pairs that keep every entry; may be 0
    sink: int = 4
    window: int = 256  # the official recent_size: a streaming head holds sink + window tokens (plus the new one
    # during a step)
    calibration_tokens: int = 2048

    fidelity = Fidelity(Source("mit-han-lab/duo-attention", "fe93c314ae87306ef6629dc16713250b4718ffe7",
                               "duo_attn/utils.py, duo_attn/patch/llama.py, eval/LongBench/pred.py"), rules=(
        Rule("heads", "per (layer, KV head): retrieval or streaming", kvlib="per (layer, KV head): retrieval or "
             "streaming"),
        Rule("which heads", "learned gates (distilled on passkey text)",
             kvlib="attention mass lost to sinks + window on a calibration text",
             differs="training the gates does not fit the study's CPU budget (kvlib.policies.duo_heads)"),
        Rule("how many", "the sparsity quantile of the gates, model-wide",
             kvlib="the sparsity quantile of the gates, model-wide"),
        Rule("knob", "sparsity, the share of streaming heads (0.5)", kvlib="budget, the share of KV entries (0.5)",
             differs="compared with the other policies at equal KV entries; retrieval_ratio sets the heads' share"),
        Rule("sink tokens", 64, setting="sink",
             differs="StreamingLLM's 4: 64 + 256 would keep most of a 512-token item on every streaming head"),
        Rule("recent tokens", 256, setting="window"),
        Rule("streaming heads at decode", "sinks, recent window and the new token",
             kvlib="sinks, recent window and the new token"),
        Rule("retrieval heads", "every entry", kvlib="every entry"),
        Rule("prefill", "dense on every head; LongBench feeds a prompt's last 50 tokens as decode steps",
             kvlib="dense on every head, the whole prompt", differs="every policy here prefills the whole prompt"),
    ), note="the evaluation path (enable_duo_attention_eval); the embedded and confirmatory profiles set window 28 "
            "for their 512-token items")

    def __post_init__(self):
        super().__post_init__()
        if self.retrieval_ratio is not None and not 0 <= self.retrieval_ratio <= 1:
            raise UserError(f"retrieval_ratio must be in [0, 1], got {self.retrieval_ratio}")
        if self.budget_tokens is not None:
            raise UserError("policy 'duo' has no budget_tokens: its knob is retrieval_ratio (or budget), its "
                            "streaming heads hold sink + window tokens")
        for name, least in (("sink", 0), ("window", 1), ("calibration_tokens", 1)):
            if not isinstance(value := getattr(self, name), int) or value < least:
                raise UserError(f"{name} must be an integer >= {least}, got {value!r}")

    def ratio_for(self, prompt_lens: list[int]) -> float:
        """The retrieval-head ratio for a batch of these prompts: retrieval_ratio, else the one at which they keep
        `budget` of their entries (the module's mapping)."""
        if self.retrieval_ratio is not None:
            return self.retrieval_ratio
        n = sum(prompt_lens) / len(prompt_lens)
        streamed = min(n, self.sink + self.window + 1)
        if n <= streamed:  # a streaming head keeps the whole prompt: every ratio holds every entry
            return 1.0
        return min(1.0, max(0.0, (self.budget * n - streamed) / (n - streamed)))

    def bind(self, model, ledger, timers):
        super().bind(model, ledger, timers)
        self.scores: torch.Tensor | None = None
        self.ratio = self.retrieval_ratio
        self.retrieval_of: list[list[int]] | None = None

    def calibrate(self, prompt):
        """Score the heads on the calibration text, unless no ratio this policy can take needs a ranking."""
        if self.retrieval_ratio in (0.0, 1.0) or (self.retrieval_ratio is None and self.budget == 1.0):
            return
        self.scores = head_scores(self.model, prompt[:self.calibration_tokens], self.sink, self.window)

    def calibration_columns(self) -> dict:
        """The retrieval ratio its budget came to, and how stable its heads are against another passage
        (kvlib.policies.duo_heads.stability)."""
        return {} if self.ratio is None else {"retrieval_ratio_used": self.ratio, **stability(
            self.model, self.ratio, self.sink, self.window, self.calibration_tokens)}

    def choose(self, ratio: float) -> None:
        """Take `ratio` of the heads as retrieval heads: the best scored, model-wide."""
        s = self.spec
        count = retrieval_count(ratio, s.num_layers, s.num_kv_heads)
        if count in (0, s.num_layers * s.num_kv_heads):  # nothing to rank
            chosen = torch.full((s.num_layers, s.num_kv_heads), bool(count))
        elif self.scores is None:
            raise ValueError("policy 'duo' needs calibrate() (the engine calls it) before start()")
        else:
            chosen = choose_retrieval(self.scores, ratio)
        self.ratio = ratio
        self.set_retrieval(chosen)

    def set_retrieval(self, chosen: torch.Tensor) -> None:
        """chosen: [layers, Hkv] bool, True for a retrieval head. Plain lists: index lists the size of a layer's heads
        are no storage to book."""
        group = self.spec.num_attention_heads // self.spec.num_kv_heads

        def queries(heads):
            return [h * group + g for h in heads for g in range(group)]
        self.retrieval_of = [[h for h, r in enumerate(layer) if r] for layer in chosen.tolist()]
        self.streaming_of = [[h for h, r in enumerate(layer) if not r] for layer in chosen.tolist()]
        self.queries_of = [(queries(r), queries(s)) for r, s in zip(self.retrieval_of, self.streaming_of)]

    def ring_slot(self, positions: torch.Tensor) -> torch.Tensor:
        """Where a streaming head keeps the token at each position: sinks in place, the rest round the window."""
        return torch.where(positions < self.sink, positions, self.sink + (positions - self.sink) % (self.window + 1))

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def start(self, batch_size, prompt_lens, max_new_tokens):
        self.choose(self.ratio_for(prompt_lens))
        s = self.spec
        capacity = max(prompt_lens) + max_new_tokens
        self.ring = min(self.sink + self.window + 1, capacity)
        retrieval = sum(map(len, self.retrieval_of))
        streaming = s.num_layers * s.num_kv_heads - retrieval
        self.head_token_bytes = 2 * s.head_dim * s.dtype_bytes  # one head's key and value for one token
        row_bytes = (retrieval * capacity + streaming * self.ring) * self.head_token_bytes
        # serving: the rows left once one prompt's streaming heads can be staged in full
        staging = streaming * max(prompt_lens) * self.head_token_bytes
        rows = self.row_capacity(batch_size, row_bytes, beside=staging)
        self.ledger.add("device", "kv_reserved", rows * row_bytes, where="duo KV cache allocation")
        d, dtype = s.head_dim, s.dtype

        def cache(heads, length):
            return torch.zeros((rows, len(heads), length, d), dtype=dtype, device=self.device)
        self.rk = [cache(h, capacity) for h in self.retrieval_of]
        self.rv = [cache(h, capacity) for h in self.retrieval_of]
        self.sk = [cache(h, self.ring) for h in self.streaming_of]
        self.sv = [cache(h, self.ring) for h in self.streaming_of]
        self.lengths = torch.zeros(rows, dtype=torch.long)  # tokens each row has seen
        self.reserved = rows * row_bytes
        self.staging: dict[int, dict] = {}  # a prefilling row: its streaming heads' prompt in full
        self.retrieval, self.streaming = retrieval, streaming

    def prepare(self, step: Step):
        if step.phase == "prefill":
            row = int(step.rows[0])
            if self.streaming and row not in self.staging:
                with self.timers.section("eviction"):
                    self._open_staging(row, int(step.start[0]), int(step.end[0]))
            return
        self.read_retrieval = step.start + 1
        self.read_streaming = self.read_retrieval.clamp(max=self.ring)
        self.write = step.rows.to(self.device), step.start.to(self.device), self.ring_slot(step.start).to(self.device)

    def _open_staging(self, row: int, held_until: int, end: int):
        """The streaming heads' view of a row for its prefill: what they kept of earlier turns (sinks and window, in
        position order), then room for the whole new prompt."""
        kept = list(range(min(self.sink, held_until))) + list(range(max(self.sink, held_until - self.window),
                                                                    held_until))
        size = len(kept) + end - held_until
        nbytes = self.streaming * size * self.head_token_bytes
        self.ledger.add("device", "kv", nbytes, where="duo streaming heads' prompt")
        d, dtype = self.spec.head_dim, self.spec.dtype
        keys = [torch.zeros((len(h), size, d), dtype=dtype, device=self.device) for h in self.streaming_of]
        values = [torch.zeros_like(k) for k in keys]
        slots = self.ring_slot(torch.tensor(kept, dtype=torch.long)).to(self.device)
        for layer in range(self.spec.num_layers):
            keys[layer][:, :len(kept)] = self.sk[layer][row][:, slots]
            values[layer][:, :len(kept)] = self.sv[layer][row][:, slots]
        # positions as plain ints: the buffer's bookkeeping, not storage to book (nor to leave on the host on a GPU)
        self.staging[row] = {"keys": keys, "values": values, "kept": kept, "new": (held_until, end),
                             "filled": len(kept)}

    def attend(self, layer, query, key, value, step: Step):
        if step.phase == "prefill":
            return self._prefill(layer, query, key, value, step)
        return self._decode(layer, query, key, value, step)

    def _store(self, layer, key, value, step) -> list[tuple]:
        """Write a prefill pass's keys and values [1, Hkv, t, D]: the retrieval heads' into their cache, the streaming
        heads' into the row's staging buffer. Returns, per kind of head, (its query heads, the keys and values it
        attends, where this pass begins among them)."""
        row, begin, t = int(step.rows[0]), int(step.start[0]), step.q_len
        end = begin + t
        retrieval, streaming = self.retrieval_of[layer], self.streaming_of[layer]
        q_retrieval, q_streaming = self.queries_of[layer]
        parts = []
        if retrieval:
            kc, vc = self.rk[layer], self.rv[layer]
            kc[row, :, begin:end] = key[0, retrieval]
            vc[row, :, begin:end] = value[0, retrieval]
            parts.append((q_retrieval, kc[row:row + 1, :, :end], vc[row:row + 1, :, :end], begin))
        if streaming:
            staged = self.staging[row]
            filled = staged["filled"]
            kc, vc = staged["keys"][layer], staged["values"][layer]
            kc[:, filled:filled + t] = key[0, streaming]
            vc[:, filled:filled + t] = value[0, streaming]
            parts.append((q_streaming, kc[None, :, :filled + t], vc[None, :, :filled + t], filled))
        return parts

    def adopt_pass(self, layer, recorded, step: Step):
        self._store(layer, recorded.key(layer), recorded.value(layer), step)

    def _prefill(self, layer, query, key, value, step):
        parts = self._store(layer, key, value, step)
        return self._by_head(query, [(q, lambda sub, k=k, v=v, b=b: prefill_attention(
            sub, k, v, b, step.prefill_mode, self.scale, self.ledger, layer)) for q, k, v, b in parts])

    def _by_head(self, query, parts):
        """Each part's attention over its query heads, put together in head order; one part: the whole query."""
        if len(parts) == 1:
            return parts[0][1](query)
        out = torch.empty_like(query)
        for heads, attend in parts:
            out[:, heads] = attend(query[:, heads])
        return out

    def _decode(self, layer, query, key, value, step):
        rows, pos, slot = self.write
        retrieval, streaming = self.retrieval_of[layer], self.streaming_of[layer]
        q_retrieval, q_streaming = self.queries_of[layer]
        parts = []
        if retrieval:
            kc, vc = self.rk[layer], self.rv[layer]
            kc[rows, :, pos] = key[:, retrieval, 0]
            vc[rows, :, pos] = value[:, retrieval, 0]
            reads = DecodeReads(kc, vc, self.read_retrieval, rows=step.rows)
            parts.append((q_retrieval, lambda sub, reads=reads: self.decode_attention(layer, sub, reads)[0]))
        if streaming:
            kc, vc = self.sk[layer], self.sv[layer]
            with self.timers.section("eviction"):  # the new token takes the slot of the one leaving the window
                kc[rows, :, slot] = key[:, streaming, 0]
                vc[rows, :, slot] = value[:, streaming, 0]
            reads = DecodeReads(kc, vc, self.read_streaming, rows=step.rows)
            parts.append((q_streaming, lambda sub, reads=reads: self.decode_attention(layer, sub, reads)[0]))
        attended = (len(retrieval) * int(self.read_retrieval.sum()) + len(streaming) * int(self.read_streaming.sum()))
        self.usage.add(layer, attended / self.spec.num_kv_heads, step.tokens_seen, len(step.rows))
        return self._by_head(query, parts)

    def after_pass(self, step: Step):
        if step.phase == "decode":
            self.lengths[step.rows] += 1
        else:
            row = int(step.rows[0])
            self.lengths[row] = int(step.start[0]) + step.q_len
            if self.streaming:
                self.staging[row]["filled"] += step.q_len
                if step.last_chunk:
                    with self.timers.section("eviction"):
                        self._close_staging(row)
        self._book()

    def _close_staging(self, row: int):
        """The prompt is in: its streaming heads keep the sinks and the window (and the token before it, whose slot
        the next one takes) in their ring; the staged prompt is freed."""
        staged = self.staging.pop(row)
        seen = int(self.lengths[row])
        positions = torch.cat([torch.tensor(staged["kept"], dtype=torch.long), torch.arange(*staged["new"])])
        keep = ((positions < self.sink) | (positions >= seen - self.window - 1)).nonzero()[:, 0]
        slots = self.ring_slot(positions[keep]).to(self.device)
        keep = keep.to(self.device)
        for layer in range(self.spec.num_layers):
            self.sk[layer][row][:, slots] = staged["keys"][layer][:, keep]
            self.sv[layer][row][:, slots] = staged["values"][layer][:, keep]

    def fork(self, src, dst):
        if src in self.staging:
            raise UserError(f"row {src} is in the middle of a prefill and cannot be forked")
        for caches in (self.rk, self.rv, self.sk, self.sv):
            for cache in caches:
                cache[dst] = cache[src]
        self.lengths[dst] = self.lengths[src]
        self._book()

    def release(self, row):
        self.lengths[row] = 0
        self.staging.pop(row, None)
        self._book()

    def _book(self):
        seen = self.lengths
        head_tokens = self.retrieval * int(seen.sum()) + self.streaming * int(seen.clamp(max=self.ring).sum())
        staged = sum(k.nbytes + v.nbytes for st in self.staging.values() for k, v in zip(st["keys"], st["values"]))
        kv = head_tokens * self.head_token_bytes + staged
        self.ledger.set("device", "duo cache", kv=kv, kv_reserved=self.reserved + staged - kv,
                        overhead=self.lengths.nbytes)

    def finish(self):
        self.rk = self.rv = self.sk = self.sv = []
        self.staging = {}
        self.ledger.set("device", kv=0, kv_reserved=0, overhead=0)

    def stats(self):
        heads = self.spec.num_layers * self.spec.num_kv_heads
        return {"retrieval_ratio": self.ratio, "retrieval_heads": sum(map(len, self.retrieval_of)), "heads": heads,
                "retrieval_heads_per_layer": [len(r) for r in self.retrieval_of], "sink": self.sink,
                "window": self.window}
