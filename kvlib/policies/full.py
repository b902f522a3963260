"""The full-cache baseline: every key and value kept, contiguous per row, as Hugging Face's static cache does.

Each row reserves room for the longest prompt plus max_new_tokens up front; the reserved-but-unused part is booked
as `kv_reserved`, the fragmentation paged memory management removes. Serving under continuous batching, it holds as
many such rows as the device capacity affords, and a request waits for a free one (as servers before vLLM reserved
a request's maximum length). Decode reads each row in place over its own length,
through the decode attention every policy shares (kvlib.kernels.decode).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.kernels.attention import prefill_attention
from kvlib.kernels.decode import DecodeReads
from kvlib.policies.base import KVPolicy, Step
from kvlib.policies.fidelity import Fidelity, Rule, Source
from kvlib.policies.registry import register


@register
@dataclass
class FullPolicy(KVPolicy):
    name = "full"
    lossless = True
    adopts_prefill = True
    one_pass_source = "EleutherAI/lm-evaluation-harness models/huggingface.py (one dense pass)"

    fidelity = Fidelity(Source("huggingface/transformers", "67dd5524d384fdf6b20f6123e7a9d74e6ed96345",
                               "src/transformers/cache_utils.py"), rules=(
        Rule("what is kept", "every key and value", kvlib="every key and value"),
        Rule("reservation", "max_cache_len slots a row, zeroed, up front",
             kvlib="max_cache_len slots a row, zeroed, up front"),
        Rule("max_cache_len", "the longest prompt + max_new_tokens", kvlib="the longest prompt + max_new_tokens"),
        Rule("a new token", "written in place at its position", kvlib="written in place at its position"),
        Rule("decode reads", "all max_cache_len slots, the unfilled masked", kvlib="each row's filled slots",
             differs="the same output; every policy here decodes with one kernel over what a row holds"),
        Rule("serving", "none: one batch at a time", kvlib="as many rows as the device capacity holds",
             differs="the study serves it under continuous batching, a request waiting for a free row as servers "
                     "before paging did"),
    ), note="StaticCache (StaticLayer): the dense cache transformers' generate keeps for a fixed-size run")

    def one_pass_keep(self, layer, query, key, scores):
        return None  # every earlier entry: lm-eval's own dense pass

    def start(self, batch_size, prompt_lens, max_new_tokens):
        s = self.spec
        capacity = max(prompt_lens) + max_new_tokens
        rows = self.row_capacity(batch_size, s.kv_bytes(capacity))  # serving: the rows a device capacity holds
        # zeros, not empty: masked-out slots still enter the matmuls, and garbage NaNs would poison them
        shape = (rows, s.num_kv_heads, capacity, s.head_dim)
        self.ledger.add("device", "kv_reserved", s.kv_bytes(rows * capacity), where="kv cache allocation")
        self.keys = [torch.zeros(shape, dtype=s.dtype, device=self.device) for _ in range(s.num_layers)]
        self.values = [torch.zeros(shape, dtype=s.dtype, device=self.device) for _ in range(s.num_layers)]
        self.lengths = torch.zeros(rows, dtype=torch.long)

    def prepare(self, step: Step):
        if step.phase == "decode":
            # moved to the cache's device once per step, not once per layer (on a GPU, 90 small synchronous copies a
            # step for a 30-layer model otherwise)
            self.slots = step.rows.to(self.device), step.start.to(self.device)
            self.read = step.start + 1  # each row's length once its new token is in

    def attend(self, layer, query, key, value, step: Step):
        kc, vc = self.keys[layer], self.values[layer]
        t = step.q_len
        if step.phase == "decode":  # every row gets one token, at its own position
            rows, pos = self.slots
            kc[rows, :, pos] = key[:, :, 0]
            vc[rows, :, pos] = value[:, :, 0]
            self.usage.add(layer, step.tokens_seen, step.tokens_seen, len(step.rows))
            return self.decode_attention(layer, query, DecodeReads(kc, vc, self.read, rows=step.rows))[0]
        row, begin = int(step.rows[0]), int(step.start[0])
        end = begin + t
        self._store_prompt(layer, key, value, step)
        return prefill_attention(query, kc[row:row + 1, :, :end], vc[row:row + 1, :, :end], begin,
                                 step.prefill_mode, self.scale, self.ledger, layer)

    def _store_prompt(self, layer, key, value, step: Step):
        row, begin = int(step.rows[0]), int(step.start[0])
        self.keys[layer][row, :, begin:begin + step.q_len] = key[0]
        self.values[layer][row, :, begin:begin + step.q_len] = value[0]

    def adopt_pass(self, layer, recorded, step: Step):
        self._store_prompt(layer, recorded.key(layer), recorded.value(layer), step)

    def after_pass(self, step: Step):
        self.lengths[step.rows] = step.start + step.q_len
        self._book()

    def fork(self, src, dst):
        n = int(self.lengths[src])
        for kc, vc in zip(self.keys, self.values):
            kc[dst, :, :n] = kc[src, :, :n]
            vc[dst, :, :n] = vc[src, :, :n]
        self.lengths[dst] = n
        self._book()

    def release(self, row):
        """The row is free for another request (its whole length stays reserved: what paged memory management
        removes)."""
        self.lengths[row] = 0
        self._book()

    def _book(self):
        per_token = self.spec.kv_bytes_per_token
        used = int(self.lengths.sum()) * per_token
        reserved = self.spec.kv_bytes(self.keys[0].shape[0] * self.keys[0].shape[2])
        self.ledger.set("device", kv=used, kv_reserved=reserved - used)

    def finish(self):
        self.keys = self.values = []
        self.ledger.set("device", kv=0, kv_reserved=0)
