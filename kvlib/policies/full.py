"""The full-cache baseline: every key and value kept, contiguous per row, as Hugging Face's static cache does.

Each row reserves room for its prompt plus max_new_tokens up front; the reserved-but-unused part is booked as
`kv_reserved`, the fragmentation paged memory management removes. Decode attends each row over its own length: on a
CPU in fp32 with kvlib's C kernel (kvlib.kernels.cpu_kernel, the same one `paged` runs), elsewhere with SDPA over the rows
padded to the longest, masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.kernels import cpu_kernel
from kvlib.kernels.attention import decode_mask, fused_attention, prefill_attention
from kvlib.policies.base import KVPolicy, Step
from kvlib.policies.registry import register


@register
@dataclass
class FullPolicy(KVPolicy):
    name = "full"
    lossless = True

    def start(self, batch_size, prompt_lens, max_new_tokens):
        s = self.spec
        capacity = max(prompt_lens) + max_new_tokens
        # zeros, not empty: masked-out slots still enter the matmuls, and garbage NaNs would poison them
        shape = (batch_size, s.num_kv_heads, capacity, s.head_dim)
        self.ledger.add("device", "kv_reserved", s.kv_bytes(batch_size * capacity), where="kv cache allocation")
        self.keys = [torch.zeros(shape, dtype=s.dtype, device=self.device) for _ in range(s.num_layers)]
        self.values = [torch.zeros(shape, dtype=s.dtype, device=self.device) for _ in range(s.num_layers)]
        self.lengths = torch.zeros(batch_size, dtype=torch.long)
        self.decode_kernel = None  # what decode attention runs: "c" (kvlib.kernels.cpu_kernel) or "torch"

    def prepare(self, step: Step):
        if step.phase == "decode":
            # each row over its own length, in place (no padding to the longest row, no copy of the rows)
            self.kernel_plan = cpu_kernel.plan_decode(self.spec, self.device, step.start)
            self.decode_kernel = "torch" if self.kernel_plan is None else "c"
            if self.kernel_plan is None:
                # indices and mask moved to the cache's device once per step, not once per layer (on a GPU, 90 small
                # synchronous copies a step for a 30-layer model otherwise)
                self.visible, self.kv_len = decode_mask(step.start, self.keys[0].shape[2], self.device)
            self.slots = step.rows.to(self.device), step.start.to(self.device)

    def attend(self, layer, query, key, value, step: Step):
        kc, vc = self.keys[layer], self.values[layer]
        t = step.q_len
        if step.phase == "decode":  # every row gets one token, at its own position
            rows, pos = self.slots
            kc[rows, :, pos] = key[:, :, 0]
            vc[rows, :, pos] = value[:, :, 0]
            self.usage.add(layer, step.tokens_seen, step.tokens_seen, len(step.rows))
            if self.kernel_plan is not None:
                with self.ledger.transient("device", "activations", self.kernel_plan.workspace_bytes,
                                           f"decode workspace, layer {layer}"):
                    return cpu_kernel.rows_decode(query, kc, vc, rows, self.kernel_plan.lengths, self.scale)
            kv_len = self.kv_len
            with self.rows_of(step.rows, kc, vc, where=f"full decode rows, layer {layer}") as (k, v):
                return fused_attention(query, k[:, :, :kv_len], v[:, :, :kv_len], self.visible, self.scale)
        row, begin = int(step.rows[0]), int(step.start[0])
        end = begin + t
        kc[row, :, begin:end] = key[0]
        vc[row, :, begin:end] = value[0]
        return prefill_attention(query, kc[row:row + 1, :, :end], vc[row:row + 1, :, :end], begin,
                                 step.prefill_mode, self.scale, self.ledger, layer)

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

    def _book(self):
        per_token = self.spec.kv_bytes_per_token
        used = int(self.lengths.sum()) * per_token
        reserved = self.spec.kv_bytes(self.keys[0].shape[0] * self.keys[0].shape[2])
        self.ledger.set("device", kv=used, kv_reserved=reserved - used)

    def stats(self):
        return {"decode_attention": self.decode_kernel}

    def finish(self):
        self.keys = self.values = []
        self.ledger.set("device", kv=0, kv_reserved=0)
