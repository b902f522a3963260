"""KIVI (Liu et al., ICML 2024): the KV cache quantized to 2 or 4 bits, asymmetrically, keys per channel and values
per token, with the most recent tokens in full precision.

Every token is kept; what shrinks is the bytes a token takes. Keys are quantized per channel over groups of
`group_size` consecutive tokens (each group stores a scale and a zero point per channel: key outliers sit in fixed
channels); values per token over groups of `group_size` channels (min(group_size, head_dim)). A residual of up to
`residual` keys stays in full precision and is quantized all at once when it fills; values keep their last `residual`
tokens in full precision, the oldest one quantized as each new token arrives. The full-precision tokens sit in a ring of
`residual` slots (token t in slot t % residual: a new value takes the slot of the one it pushes out). The codes are
packed for real, 8 / bits codes to a uint8 (a 16-bit code takes two bytes), beside scales and zero points in the
model's dtype (kvlib.kernels.quantized); the ledger books
those bytes (the codes, scales and zero points of the quantized tokens, and the residual's full-precision entries) as
`kv`, the rest of each row's allocation as `kv_reserved`.

Decode reads the codes where they lie: the decode attention every policy shares (kvlib.kernels.decode) scores a key
group from its codes and dequantizes each coded value as it reads it, as KIVI's fused kernels do on CUDA; no
full-precision copy of the cache is made (the PyTorch path, on a GPU or without a compiler, makes one). Its decode-step
store (the value leaving the ring, a key ring that fills) is one C call a layer there (`_store_token`). A prefill that
extends a row (a later chunk or turn) attends a dequantized copy of what the row holds, booked as activations while it
lives. `quantize=False` runs the same
mechanism (key groups flushed from the residual, values leaving it one at a time, byte arrays, the kernel's coded
reads) with each value's raw bytes instead of codes: the check that the mechanism is exact, token for token equal to
`full`. `bits=16` quantizes with an error below 2^-16 of
each group's range (teacher-forced log-probabilities within 1e-3 of full's; greedy output can still part at a near
tie).

Read: jy-yuan/KIVI `quant/new_pack.py` (quant_and_pack_kcache / vcache: min-max asymmetric quantization, scale =
(max - min) / (2^bits - 1), codes packed into int32 along tokens for keys and channels for values) and
`models/llama_kivi.py` (prefill quantizes all but T mod residual keys and all but the last residual values; at decode a
full key residual is quantized at once after the step's attention, so the step that fills it attends it in full
precision, as here; one value token at a time). Deviations:
- Keys are scored as the official fused kernels score them, the key scales folded into the query and the packed codes
  multiplied directly (a group's channel at a time, 16 tokens to a vector); values are dequantized a token at a time
  into an L1-resident vector and weighted as every policy's are.
- Codes are packed into uint8 (the official packs into int32): keys along a group's tokens, channel by channel, as the
  official; values along the channels. The same bytes.
- Prefill attends over the chunk in full precision and over earlier chunks (or earlier turns) as stored, quantized: the
  official prefill is one pass over the full-precision prompt, which kvlib's fused prefill reproduces.
- A zero range (max = min) quantizes to code 0 with zero scale instead of dividing by zero.
- The oldest value leaves the residual (quantized) before a step's attention, not after it as in the official code: a
  step attends `residual` full-precision values rather than residual + 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlib.errors import UserError
from kvlib.kernels import cpu_kernel
from kvlib.kernels.attention import prefill_attention
from kvlib.kernels.decode import DecodeReads
from kvlib.kernels.quantized import BITS, QuantizedKV, dequantize, encode_keys, encode_values
from kvlib.policies.base import KVPolicy, Step
from kvlib.policies.fidelity import Fidelity, Rule, Source
from kvlib.policies.registry import register

CACHES = ("key_codes", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero", "key_residual",
          "value_residual")


@register
@dataclass
class KIVIPolicy(KVPolicy):
    name = "kivi"
    small_example: ClassVar[dict] = {"bits": 2, "group_size": 8, "residual": 16}
    # the packed layout, holding raw bytes
    keeps_all_example: ClassVar[dict] = {"quantize": False, "group_size": 8, "residual": 16}
    adopts_prefill = True

    bits: int = 2
    group_size: int = 32  # tokens a key scale covers; channels a value scale covers (the official default)
    residual: int = 128  # most recent tokens kept in full precision (the official residual_length)
    quantize: bool = True  # False: the same groups, residual and byte layout holding each value's raw bytes

    fidelity = Fidelity(Source("jy-yuan/KIVI", "876b4d2d08e3b1d5f70d0969c299d8c7c42ddfb6",
                               "models/llama_kivi.py, quant/new_pack.py"), rules=(
        Rule("bits (keys and values)", 2, setting="bits"),
        Rule("group size", 32, setting="group_size"),
        Rule("residual (full-precision tokens)", 128, setting="residual"),
        Rule("quantized", True, setting="quantize"),
        Rule("keys", "per channel over group_size tokens, min-max", kvlib="per channel over group_size tokens, "
             "min-max"),
        Rule("values", "per token over group_size channels, min-max",
             kvlib="per token over group_size channels, min-max"),
        Rule("prefill", "keys: all but T mod residual coded; values: all but the last residual",
             kvlib="keys: all but T mod residual coded; values: all but the last residual"),
        Rule("a key residual that fills", "attended in full precision, then coded",
             kvlib="attended in full precision, then coded"),
        Rule("values at decode", "residual + 1 in full precision, the oldest coded after",
             kvlib="residual in full precision, the oldest coded before",
             differs="a ring of residual slots, the new value in the leaving one's; one value coded a step early"),
        Rule("a constant group", "divides by a zero scale", kvlib="code 0, scale 0",
             differs="the official's 0 / 0 would make the group NaN"),
    ), note="the paper's KIVI-2 setting (group 32, residual 128); utils/process_args.py defaults to group 128, "
            "example.py to residual 32")

    def kv_bits(self) -> int:
        return self.bits if self.quantize else super().kv_bits()  # (the last `residual` tokens at full precision)

    def __post_init__(self):
        if self.bits not in BITS:
            raise UserError(f"bits must be one of {list(BITS)}, got {self.bits!r}")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise UserError(f"group_size must be an integer >= 1, got {self.group_size!r}")
        if self.quantize and (self.group_size * self.bits) % 8:
            raise UserError(f"group_size must fill whole bytes with {self.bits}-bit codes (a key group's codes are "
                            f"packed along its tokens): a multiple of {8 // math.gcd(8, self.bits)}, got "
                            f"{self.group_size!r}")
        if not isinstance(self.residual, int) or self.residual < self.group_size or self.residual % self.group_size:
            raise UserError(f"residual must be a positive multiple of group_size={self.group_size} (keys are "
                            f"quantized a whole residual at a time), got {self.residual!r}")

    def bind(self, model, ledger, timers):
        super().bind(model, ledger, timers)
        d = self.spec.head_dim
        self.value_group = min(self.group_size, d)
        self.code_bits = self.bits if self.quantize else 8 * self.spec.dtype_bytes
        if d % self.value_group or (d * self.code_bits) % 8:
            raise UserError(f"policy 'kivi' needs head_dim ({d}) divisible by its value group ({self.value_group}) "
                            f"and by 8 / bits")

    # -- storage ---------------------------------------------------------------------------------------------------
    def start(self, batch_size, prompt_lens, max_new_tokens):
        r = self.residual
        cap = -(-(max(prompt_lens) + max_new_tokens) // r) * r
        row_bytes = sum(math.prod(shape) * torch.empty((), dtype=dt).element_size()
                        for shape, dt in self._shapes(1, cap).values())
        rows = self.row_capacity(batch_size, row_bytes)
        shapes = self._shapes(rows, cap)
        nbytes = rows * row_bytes  # every array is one slice a row
        self.ledger.add("device", "kv_reserved", nbytes, where="kivi cache allocation")
        for attr, (shape, dt) in shapes.items():
            setattr(self, attr, torch.zeros(shape, dtype=dt, device=self.device))
        self.lengths = torch.zeros(rows, dtype=torch.long)
        self.allocated = nbytes

    def _shapes(self, rows: int, cap: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Each array's shape and dtype, for `rows` rows of `cap` tokens."""
        s, r, g = self.spec, self.residual, self.group_size
        base = (s.num_layers, rows, s.num_kv_heads)
        code_bytes = s.head_dim * self.code_bits // 8
        scales = s.head_dim if self.quantize else 0
        return {"key_codes": ((*base, cap // g, s.head_dim, g * self.code_bits // 8), torch.uint8),
                "key_scale": ((*base, cap // g, scales), s.dtype), "key_zero": ((*base, cap // g, scales), s.dtype),
                "value_codes": ((*base, cap, code_bytes), torch.uint8),
                "value_scale": ((*base, cap, scales // self.value_group), s.dtype),
                "value_zero": ((*base, cap, scales // self.value_group), s.dtype),
                "key_residual": ((*base, r, s.head_dim), s.dtype), "value_residual": ((*base, r, s.head_dim), s.dtype)}

    def release(self, row):
        """The row is free for another request; its whole length stays reserved (KIVI shrinks a token's bytes, not
        the reservation)."""
        self.lengths[row] = 0
        self._book()

    def prepare(self, step: Step):
        grown = int((step.start + step.q_len).max())
        if grown > self.value_codes.shape[3]:
            raise UserError(f"a row grew to {grown} tokens, past the lengths given to start() "
                            f"({self.value_codes.shape[3]} slots)")

    def keys_quantized(self, lengths: torch.Tensor) -> torch.Tensor:
        """Keys held as codes in rows of these lengths: whole residuals (a full one is quantized at once)."""
        return lengths // self.residual * self.residual

    def values_quantized(self, lengths: torch.Tensor) -> torch.Tensor:
        """Values held as codes: all but the last `residual`."""
        return (lengths - self.residual).clamp(min=0)

    def token_bytes(self) -> tuple[int, int, int]:
        """Bytes per KV head and layer: (a quantized key, a quantized value, a full-precision key or value)."""
        s = self.spec
        if not self.quantize:
            return s.head_dim * s.dtype_bytes, s.head_dim * s.dtype_bytes, s.head_dim * s.dtype_bytes
        code = s.head_dim * self.bits // 8
        key = code + 2 * s.head_dim * s.dtype_bytes / self.group_size
        value = code + 2 * s.head_dim // self.value_group * s.dtype_bytes
        return key, value, s.head_dim * s.dtype_bytes

    def held_bytes(self) -> int:
        s = self.spec
        key, value, plain = self.token_bytes()
        n = self.lengths
        kq, vq = self.keys_quantized(n), self.values_quantized(n)
        per_head = kq * key + (n - kq) * plain + vq * value + (n - vq) * plain
        return round(float(per_head.sum()) * s.num_layers * s.num_kv_heads)

    def _book(self):
        used = self.held_bytes()
        self.ledger.set("device", "kivi cache", kv=used, kv_reserved=self.allocated - used)

    # -- writing ---------------------------------------------------------------------------------------------------
    def _write_key_codes(self, layer, row, at, keys):
        """Keys [Hkv, m, D] (m a multiple of group_size) as codes of tokens at..at+m of a row."""
        codes, scale, zero = encode_keys(keys, self.code_bits, self.group_size)
        g = self.group_size
        self.key_codes[layer, row, :, at // g:(at + keys.shape[1]) // g] = codes
        self.key_scale[layer, row, :, at // g:(at + keys.shape[1]) // g] = scale
        self.key_zero[layer, row, :, at // g:(at + keys.shape[1]) // g] = zero

    def _write_value_codes(self, layer, rows, tokens, values):
        """Values [m, Hkv, D] as codes of token tokens[i] of row rows[i] (index tensors [m])."""
        codes, scale, zero = encode_values(values, self.code_bits, self.value_group)
        self.value_codes[layer, rows, :, tokens] = codes
        self.value_scale[layer, rows, :, tokens] = scale
        self.value_zero[layer, rows, :, tokens] = zero

    def _store_prompt(self, layer, row, begin, keys, values):
        """A prefill pass's keys and values [Hkv, t, D] after a row's first `begin` tokens."""
        r, t = self.residual, keys.shape[1]
        n = begin + t
        ring = torch.arange(n) % r
        kq, kq_now = begin // r * r, n // r * r  # keys: the ring's tokens kq.. lie in order in slots 0..
        pending = torch.cat([self.key_residual[layer, row, :, :begin - kq], keys], dim=1)
        if kq_now > kq:
            self._write_key_codes(layer, row, kq, pending[:, :kq_now - kq])
        self.key_residual[layer, row, :, :n - kq_now] = pending[:, kq_now - kq:]
        vq, vq_now = max(begin - r, 0), max(n - r, 0)
        pending = torch.cat([self.value_residual[layer, row, :, ring[vq:begin]], values], dim=1)
        if vq_now > vq:
            tokens = torch.arange(vq, vq_now)
            self._write_value_codes(layer, torch.full_like(tokens, row), tokens, pending[:, :vq_now - vq].transpose(0, 1))
        self.value_residual[layer, row, :, ring[vq_now:n]] = pending[:, vq_now - vq:]

    def _store_token(self, layer, rows, begin, key, value):
        """A decode step's key and value [B, Hkv, D] of rows holding `begin` tokens: a value pushed out of the ring
        becomes codes, and a key residual that fills is quantized as a whole. On kvlib's C kernels one call
        (kvlib.kernels.cpu_kernel.kivi_store); elsewhere the PyTorch ops below, which write the same codes."""
        if self.decode_kernel == "c":
            cpu_kernel.kivi_store(key, value, rows, begin, self.key_residual[layer], self.value_residual[layer],
                                  self._coded(layer), self.residual)
            return
        r = self.residual
        slot = begin % r
        leaving = begin >= r  # the value of token begin - r sits in the slot the new token takes
        if leaving.any():
            out_rows, out_slots = rows[leaving], slot[leaving]
            self._write_value_codes(layer, out_rows, begin[leaving] - r,
                                    self.value_residual[layer, out_rows, :, out_slots])
        self.value_residual[layer, rows, :, slot] = value
        self.key_residual[layer, rows, :, slot] = key
        filled = slot == r - 1
        for row, last in zip(rows[filled].tolist(), begin[filled].tolist()):
            self._write_key_codes(layer, row, last + 1 - r, self.key_residual[layer, row])

    # -- reading ---------------------------------------------------------------------------------------------------
    def _coded(self, layer: int, lengths: torch.Tensor | None = None, keys_coded: torch.Tensor | None = None
               ) -> QuantizedKV:
        """One layer's codes, as held by rows of these lengths (None: a writer's view, the counts unset); keys_coded:
        the keys read as codes, where not all those held are."""
        counts = (None, None) if lengths is None else (
            self.keys_quantized(lengths) if keys_coded is None else keys_coded, self.values_quantized(lengths))
        return QuantizedKV(*(getattr(self, name)[layer] for name in CACHES[:6]), *counts, bits=self.code_bits,
                           group=self.group_size, value_group=self.value_group)

    def _reads(self, layer: int, rows: torch.Tensor, lengths: torch.Tensor,
               keys_coded: torch.Tensor | None = None) -> DecodeReads:
        """What rows holding `lengths` tokens read: their codes in place, the rest in the residual ring."""
        return DecodeReads(self.key_residual[layer], self.value_residual[layer], lengths, rows=rows,
                           quantized=self._coded(layer, lengths, keys_coded))

    # -- the contract ----------------------------------------------------------------------------------------------
    def prefill_arithmetic(self, mode, passes):
        """A later chunk attends the earlier ones dequantized, not as a dense prefill would: one pass only."""
        return super().prefill_arithmetic(mode, passes) if passes == 1 else None

    def adopt_pass(self, layer, recorded, step: Step):
        with self.timers.section("offload"):
            self._store_prompt(layer, int(step.rows[0]), int(step.start[0]), recorded.key(layer)[0],
                               recorded.value(layer)[0])

    def attend(self, layer, query, key, value, step: Step):
        s = self.spec
        if step.phase == "prefill":
            row, begin, t = int(step.rows[0]), int(step.start[0]), step.q_len
            held = 2 * s.num_kv_heads * (begin + t) * s.head_dim * s.dtype_bytes
            with self.ledger.transient("device", "activations", held, f"kivi dequantized cache, layer {layer}"):
                if begin:
                    reads = self._reads(layer, step.rows, step.start)
                    k, v = dequantize(reads.quantized, reads.keys, reads.values, step.rows, step.start)
                    k, v = torch.cat([k, key], dim=2), torch.cat([v, value], dim=2)
                else:
                    k, v = key, value
                out = prefill_attention(query, k, v, begin, step.prefill_mode, self.scale, self.ledger, layer)
            with self.timers.section("offload"):
                self._store_prompt(layer, row, begin, key[0], value[0])
            return out
        rows, n = step.rows, step.start + 1
        with self.timers.section("offload"):
            self._store_token(layer, rows, step.start, key[:, :, 0], value[:, :, 0])
        self.usage.add(layer, step.tokens_seen, step.tokens_seen, len(rows))
        # the keys coded before this step: a key residual that filled now is attended in full precision (still in
        # its ring) and read as codes from the next step on, as the official step quantizes it after its attention
        return self.decode_attention(layer, query, self._reads(layer, rows, n, self.keys_quantized(step.start)))[0]

    def after_pass(self, step: Step):
        self.lengths[step.rows] = step.start + step.q_len
        self._book()

    def fork(self, src, dst):
        for attr in CACHES:
            cache = getattr(self, attr)
            cache[:, dst] = cache[:, src]
        self.lengths[dst] = self.lengths[src]
        self._book()

    def finish(self):
        for attr in CACHES:
            setattr(self, attr, None)
        self.ledger.set("device", kv=0, kv_reserved=0)

    def stats(self):
        key, value, plain = self.token_bytes()
        return {"bits": self.bits, "kv_bytes_per_quantized_token": (key + value) * self.spec.num_layers
                * self.spec.num_kv_heads, "kv_bytes_per_full_precision_token": 2 * plain * self.spec.num_layers
                * self.spec.num_kv_heads}
