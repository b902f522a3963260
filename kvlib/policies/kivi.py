"""KIVI (Liu et al., ICML 2024): the KV cache quantized to 2 or 4 bits, asymmetrically, keys per channel and values
per token, with the most recent tokens in full precision.

Every token is kept; what shrinks is the bytes a token takes. Keys are quantized per channel over groups of
`group_size` consecutive tokens (each group stores a scale and a zero point per channel: key outliers sit in fixed
channels); values per token over groups of `group_size` channels (min(group_size, head_dim)). A residual of up to
`residual` keys stays in full precision and is quantized all at once when it fills; values keep their last `residual`
tokens in full precision, the oldest one quantized as each new token arrives. The codes are packed for real, 8 / bits
codes to a uint8 (a 16-bit code takes two bytes), beside scales and zero points in the model's dtype; the ledger books
those bytes (the codes, scales and zero points of the quantized tokens, and the residual's full-precision entries) as
`kv`, the rest of each row's allocation as `kv_reserved`.

Attention dequantizes a row's cache into a working copy, booked as activations while it lives; decode then reads that
copy through the decode attention every policy shares (kvlib.kernels.decode). `quantize=False` runs the same mechanism (key groups flushed from the residual, values
leaving it one at a time, byte arrays, reassembly for attention) with each value's raw bytes instead of codes: the
check that the mechanism is exact, token for token equal to `full`. `bits=16` quantizes with an error below 2^-16 of
each group's range (teacher-forced log-probabilities within 1e-3 of full's; greedy output can still part at a near
tie).

Read: jy-yuan/KIVI `quant/new_pack.py` (quant_and_pack_kcache / vcache: min-max asymmetric quantization, scale =
(max - min) / (2^bits - 1), codes packed into int32 along tokens for keys and channels for values) and
`models/llama_kivi.py` (prefill quantizes all but T mod residual keys and all but the last residual values; at decode a
full key residual is quantized at once, one value token at a time). Deviations:
- No fused dequantize-matmul kernel (the official code has CUDA/Triton ones): on a CPU the cache is dequantized into a
  transient full-precision copy per layer, booked as activations; the KV bytes held are the packed ones, but the time
  of a decode step is not what a fused kernel would take.
- Codes are packed into uint8 along the channels for keys and values alike (the official packs keys along tokens into
  int32): the same bytes, and a token-major layout that a row's growing length does not reshape.
- Prefill attends over the chunk in full precision and over earlier chunks (or earlier turns) as stored, quantized: the
  official prefill is one pass over the full-precision prompt, which kvlib's fused prefill reproduces.
- A zero range (max = min) quantizes to code 0 with zero scale instead of dividing by zero.
- The oldest value leaves the residual (quantized) before a step's attention, not after it as in the official code: a
  step attends `residual` full-precision values rather than residual + 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlib.errors import UserError
from kvlib.kernels.attention import prefill_attention
from kvlib.kernels.decode import DecodeReads
from kvlib.policies.base import KVPolicy, Step
from kvlib.policies.registry import register

BITS = (2, 4, 8, 16)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes [..., D] in [0, 2^bits) -> uint8 [..., D * bits / 8]."""
    if bits == 16:
        return torch.stack([codes & 255, codes >> 8], dim=-1).flatten(-2).to(torch.uint8)
    per = 8 // bits
    grouped = codes.view(*codes.shape[:-1], -1, per).to(torch.int32)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=codes.device)
    return (grouped << shifts).sum(dim=-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., D * bits / 8] -> integer codes [..., D] (int32)."""
    data = packed.to(torch.int32)
    if bits == 16:
        pairs = data.view(*data.shape[:-1], -1, 2)
        return pairs[..., 0] | (pairs[..., 1] << 8)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=packed.device)
    return ((data[..., None] >> shifts) & (2 ** bits - 1)).flatten(-2)


def quantize(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max quantization of x over `dim`: (int codes, scale, zero) with x ~ codes x scale + zero."""
    zero = x.amin(dim=dim, keepdim=True)
    scale = (x.amax(dim=dim, keepdim=True) - zero) / (2 ** bits - 1)
    codes = ((x - zero) / torch.where(scale > 0, scale, 1)).round().clamp(0, 2 ** bits - 1).to(torch.int32)
    return codes, scale, zero


@register
@dataclass
class KIVIPolicy(KVPolicy):
    name = "kivi"

    bits: int = 2
    group_size: int = 32  # tokens a key scale covers; channels a value scale covers (the official default)
    residual: int = 128  # most recent tokens kept in full precision (the official residual_length)
    quantize: bool = True  # False: the same groups, residual and byte layout holding each value's raw bytes

    def __post_init__(self):
        if self.bits not in BITS:
            raise UserError(f"bits must be one of {list(BITS)}, got {self.bits!r}")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise UserError(f"group_size must be an integer >= 1, got {self.group_size!r}")
        if not isinstance(self.residual, int) or self.residual < self.group_size or self.residual % self.group_size:
            raise UserError(f"residual must be a positive multiple of group_size={self.group_size} (keys are "
                            f"quantized a whole residual at a time), got {self.residual!r}")

    def bind(self, model, ledger, timers):
        super().bind(model, ledger, timers)
        d = self.spec.head_dim
        self.value_group = min(self.group_size, d)
        if d % self.value_group or (d * self.bits) % 8:
            raise UserError(f"policy 'kivi' needs head_dim ({d}) divisible by its value group ({self.value_group}) "
                            f"and by 8 / bits")

    # -- storage ---------------------------------------------------------------------------------------------------
    def start(self, batch_size, prompt_lens, max_new_tokens):
        s, r, g = self.spec, self.residual, self.group_size
        cap = -(-(max(prompt_lens) + max_new_tokens) // r) * r
        base = (s.num_layers, batch_size, s.num_kv_heads)
        code_bytes = s.head_dim * (self.bits if self.quantize else 8 * s.dtype_bytes) // 8
        scales = s.head_dim if self.quantize else 0
        shapes = {"key_codes": ((*base, cap, code_bytes), torch.uint8),
                  "key_scale": ((*base, cap // g, scales), s.dtype), "key_zero": ((*base, cap // g, scales), s.dtype),
                  "value_codes": ((*base, cap, code_bytes), torch.uint8),
                  "value_scale": ((*base, cap, scales // self.value_group), s.dtype),
                  "value_zero": ((*base, cap, scales // self.value_group), s.dtype),
                  "key_residual": ((*base, r, s.head_dim), s.dtype), "value_residual": ((*base, r, s.head_dim), s.dtype)}
        nbytes = sum(math.prod(shape) * torch.empty((), dtype=dt).element_size() for shape, dt in shapes.values())
        self.ledger.add("device", "kv_reserved", nbytes, where="kivi cache allocation")
        for attr, (shape, dt) in shapes.items():
            setattr(self, attr, torch.zeros(shape, dtype=dt, device=self.device))
        self.lengths = torch.zeros(batch_size, dtype=torch.long)
        self.keys_quantized = torch.zeros(batch_size, dtype=torch.long)  # a multiple of `residual`
        self.allocated = nbytes

    def prepare(self, step: Step):
        grown = int((step.start + step.q_len).max())
        if grown > self.key_codes.shape[3]:
            raise UserError(f"a row grew to {grown} tokens, past the lengths given to start() "
                            f"({self.key_codes.shape[3]} slots)")

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
        n, kq = self.lengths, self.keys_quantized
        vq = (n - self.residual).clamp(min=0)
        per_head = kq * key + (n - kq) * plain + vq * value + (n - vq) * plain
        return round(float(per_head.sum()) * s.num_layers * s.num_kv_heads)

    def _book(self):
        used = self.held_bytes()
        self.ledger.set("device", "kivi cache", kv=used, kv_reserved=self.allocated - used)

    # -- writing ---------------------------------------------------------------------------------------------------
    def _store_keys(self, layer, row, begin, keys):
        """Append keys [Hkv, t, D] after `begin` tokens; a full residual is quantized in groups of group_size."""
        r, g, kq = self.residual, self.group_size, int(self.keys_quantized[row])
        pending = torch.cat([self.key_residual[layer, row, :, :begin - kq], keys], dim=1)
        full = pending.shape[1] // r * r
        if full and not self.quantize:
            self.key_codes[layer, row, :, kq:kq + full] = pending[:, :full].contiguous().view(torch.uint8)
        elif full:
            grouped = pending[:, :full].reshape(pending.shape[0], full // g, g, -1)
            codes, scale, zero = quantize(grouped, dim=2, bits=self.bits)
            self.key_codes[layer, row, :, kq:kq + full] = pack(codes.flatten(1, 2), self.bits)
            self.key_scale[layer, row, :, kq // g:(kq + full) // g] = scale[:, :, 0]
            self.key_zero[layer, row, :, kq // g:(kq + full) // g] = zero[:, :, 0]
        rest = pending[:, full:]
        self.key_residual[layer, row, :, :rest.shape[1]] = rest
        return kq + full

    def _store_values(self, layer, row, begin, values):
        """Append values [Hkv, t, D]; all but the last `residual` tokens are quantized per token."""
        r = self.residual
        vq = max(begin - r, 0)
        pending = torch.cat([self.value_residual[layer, row, :, :begin - vq], values], dim=1)
        n = begin + values.shape[1]
        now_quantized = max(n - r, 0)
        if now_quantized > vq and not self.quantize:
            self.value_codes[layer, row, :, vq:now_quantized] = pending[:, :now_quantized - vq].contiguous().view(
                torch.uint8)
        elif now_quantized > vq:
            x = pending[:, :now_quantized - vq]
            codes, scale, zero = quantize(x.reshape(*x.shape[:2], -1, self.value_group), dim=3, bits=self.bits)
            self.value_codes[layer, row, :, vq:now_quantized] = pack(codes.flatten(2), self.bits)
            self.value_scale[layer, row, :, vq:now_quantized] = scale[..., 0]
            self.value_zero[layer, row, :, vq:now_quantized] = zero[..., 0]
        rest = pending[:, now_quantized - vq:]
        self.value_residual[layer, row, :, :rest.shape[1]] = rest

    # -- reading ---------------------------------------------------------------------------------------------------
    def _dequantized(self, layer: int, rows: torch.Tensor, lengths: torch.Tensor, kq: torch.Tensor):
        """Full-precision keys and values [B, Hkv, max(lengths), D] of rows holding `lengths` tokens, of which `kq`
        keys are quantized (the rest of the keys, and the last `residual` values, are in the residuals): views of
        [B, Hkv, max(lengths) + residual, D] buffers."""
        g, r, d = self.group_size, self.residual, self.spec.head_dim
        n = int(lengths.max())
        kq_max, vq = int(kq.max()), (lengths - r).clamp(min=0)
        vq_max = int(vq.max())
        k = torch.zeros(len(rows), self.spec.num_kv_heads, n + r, d, dtype=self.spec.dtype, device=self.device)
        v = torch.zeros_like(k)
        if kq_max and not self.quantize:
            k[:, :, :kq_max] = self.key_codes[layer, rows, :, :kq_max].contiguous().view(self.spec.dtype)
        elif kq_max:
            codes = unpack(self.key_codes[layer, rows, :, :kq_max], self.bits).to(self.spec.dtype)
            grouped = codes.view(*codes.shape[:2], kq_max // g, g, d)
            scale, zero = self.key_scale[layer, rows, :, :kq_max // g], self.key_zero[layer, rows, :, :kq_max // g]
            k[:, :, :kq_max] = (grouped * scale[:, :, :, None] + zero[:, :, :, None]).flatten(2, 3)
        if vq_max and not self.quantize:
            v[:, :, :vq_max] = self.value_codes[layer, rows, :, :vq_max].contiguous().view(self.spec.dtype)
        elif vq_max:
            codes = unpack(self.value_codes[layer, rows, :, :vq_max], self.bits).to(self.spec.dtype)
            grouped = codes.view(*codes.shape[:3], -1, self.value_group)
            scale, zero = self.value_scale[layer, rows, :, :vq_max], self.value_zero[layer, rows, :, :vq_max]
            v[:, :, :vq_max] = (grouped * scale[..., None] + zero[..., None]).flatten(3)
        slot = torch.arange(r)[None, :]
        for cache, residual, first, count in ((k, self.key_residual, kq, lengths - kq),
                                              (v, self.value_residual, vq, lengths - vq)):
            # residual slot j holds token first + j; slots past the row's count go to the discarded tail
            where = torch.where(slot < count[:, None], first[:, None] + slot, n + slot).to(self.device)
            index = where[:, None, :, None].expand(-1, cache.shape[1], -1, d)
            cache.scatter_(2, index, residual[layer, rows])
        return k[:, :, :n], v[:, :, :n]

    # -- the contract ----------------------------------------------------------------------------------------------
    def attend(self, layer, query, key, value, step: Step):
        s = self.spec
        if step.phase == "prefill":
            row, begin, t = int(step.rows[0]), int(step.start[0]), step.q_len
            held = 2 * s.num_kv_heads * (begin + t) * s.head_dim * s.dtype_bytes
            with self.ledger.transient("device", "activations", held, f"kivi dequantized cache, layer {layer}"):
                if begin:
                    k, v = self._dequantized(layer, step.rows, step.start, self.keys_quantized[step.rows])
                    k, v = torch.cat([k, key], dim=2), torch.cat([v, value], dim=2)
                else:
                    k, v = key, value
                out = prefill_attention(query, k, v, begin, step.prefill_mode, self.scale, self.ledger, layer)
            with self.timers.section("offload"):
                self.next_quantized = {row: self._store_keys(layer, row, begin, key[0])}
                self._store_values(layer, row, begin, value[0])
            return out
        rows, n = step.rows, step.start + 1
        with self.timers.section("offload"):
            self.next_quantized = {}
            for i, row in enumerate(rows.tolist()):
                begin = int(step.start[i])
                self.next_quantized[row] = self._store_keys(layer, row, begin, key[i])
                self._store_values(layer, row, begin, value[i])
        held = 2 * len(rows) * s.num_kv_heads * (int(n.max()) + self.residual) * s.head_dim * s.dtype_bytes
        with self.ledger.transient("device", "activations", held, f"kivi dequantized cache, layer {layer}"):
            # this layer's store may have just flushed the residual into codes: read up to what it holds now
            flushed = torch.tensor([self.next_quantized[r] for r in rows.tolist()])
            k, v = self._dequantized(layer, rows, n, flushed)
            self.usage.add(layer, step.tokens_seen, step.tokens_seen, len(rows))
            return self.decode_attention(layer, query, DecodeReads(k, v, n, rows=torch.arange(len(rows))))[0]

    def after_pass(self, step: Step):
        for row, kq in self.next_quantized.items():
            self.keys_quantized[row] = kq
        self.lengths[step.rows] = step.start + step.q_len
        self._book()

    def fork(self, src, dst):
        for attr in ("key_codes", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero",
                     "key_residual", "value_residual"):
            cache = getattr(self, attr)
            cache[:, dst] = cache[:, src]
        self.lengths[dst], self.keys_quantized[dst] = self.lengths[src], self.keys_quantized[src]
        self._book()

    def finish(self):
        for attr in ("key_codes", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero",
                     "key_residual", "value_residual"):
            setattr(self, attr, None)
        self.ledger.set("device", kv=0, kv_reserved=0)

    def stats(self):
        key, value, plain = self.token_bytes()
        return {"bits": self.bits, "kv_bytes_per_quantized_token": (key + value) * self.spec.num_layers
                * self.spec.num_kv_heads, "kv_bytes_per_full_precision_token": 2 * plain * self.spec.num_layers
                * self.spec.num_kv_heads}
