"""A KV cache whose older tokens are low-bit codes (KIVI's layout), as the decode attention reads it in place.

Keys are quantized per channel over groups of `group` consecutive tokens (a scale and a zero point per channel and
group: key outliers sit in fixed channels), values per token over groups of `value_group` channels; x ~ code x scale +
zero, min-max asymmetric. Codes are packed into uint8, 8 / bits to a byte, lowest bits first (a 16-bit code takes two
bytes): a key group's codes channel by channel, each along the group's tokens (as KIVI packs them), a value's along its
channels. What a policy keeps in full precision (KIVI's residual) is a ring of `residual` slots,
token t in slot t % residual, read through the ordinary layout of kvlib.kernels.decode.

The C kernel reads the codes where they lie (a key group's scores channel by channel against the query times the
channel's scale, a vector of tokens at a time; a value dequantized into a vector that stays in L1), so a decode step
reads the codes, not a full-precision copy; the PyTorch path (GPU, other dtypes, no compiler) dequantizes the rows
into a copy (`dequantize`) and attends that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (2, 4, 8, 16)
RAW_BITS = 32  # "codes" that are each value's own fp32 bytes, no scales: the layout's exactness check


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
    """Asymmetric min-max quantization of x over `dim`: (int codes, scale, zero) with x ~ codes x scale + zero. A zero
    range quantizes to code 0 with zero scale instead of dividing by zero."""
    zero = x.amin(dim=dim, keepdim=True)
    scale = (x.amax(dim=dim, keepdim=True) - zero) / (2 ** bits - 1)
    codes = ((x - zero) / torch.where(scale > 0, scale, 1)).round().clamp(0, 2 ** bits - 1).to(torch.int32)
    return codes, scale, zero


def encode_keys(keys: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys [..., T, D] (T a multiple of group) -> (packed codes [..., T / group, D, group x bits / 8], each channel's
    along the group's tokens; scale and zero [..., T / group, D]); with RAW_BITS the raw bytes and empty scales."""
    *lead, t, d = keys.shape
    grouped = keys.reshape(*lead, t // group, group, d)
    if bits == RAW_BITS:
        empty = keys.new_empty(*lead, t // group, 0)
        return grouped.transpose(-1, -2).contiguous().view(torch.uint8), empty, empty
    codes, scale, zero = quantize(grouped, dim=-2, bits=bits)
    return pack(codes.transpose(-1, -2), bits), scale.squeeze(-2), zero.squeeze(-2)


def encode_values(values: torch.Tensor, bits: int, value_group: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values [..., D] -> (packed codes [..., code bytes], scale and zero [..., D / value_group])."""
    if bits == RAW_BITS:
        empty = values.new_empty(*values.shape[:-1], 0)
        return values.contiguous().view(torch.uint8), empty, empty
    codes, scale, zero = quantize(values.reshape(*values.shape[:-1], -1, value_group), dim=-1, bits=bits)
    return pack(codes.flatten(-2), bits), scale.squeeze(-1), zero.squeeze(-1)


@dataclass
class QuantizedKV:
    """One layer's coded tokens: query row b's keys of tokens t < keys_quantized[b] and values of tokens t <
    values_quantized[b] are codes of cache row DecodeReads.rows[b]; its other tokens are in the residual ring
    (DecodeReads.keys / values [N, Hkv, residual, D]).

    key_codes [N, Hkv, capacity / group, D, group * bits / 8], value_codes [N, Hkv, capacity, D * bits / 8] uint8;
    key_scale, key_zero [N, Hkv, capacity / group, D];
    value_scale, value_zero [N, Hkv, capacity, D / value_group] (empty in the last dimension for RAW_BITS)."""

    key_codes: torch.Tensor
    key_scale: torch.Tensor
    key_zero: torch.Tensor
    value_codes: torch.Tensor
    value_scale: torch.Tensor
    value_zero: torch.Tensor
    keys_quantized: torch.Tensor | None  # [B] int64 (None where only written, not read)
    values_quantized: torch.Tensor | None  # [B] int64
    bits: int
    group: int
    value_group: int


def dequantize(quantized: QuantizedKV, residual_keys: torch.Tensor, residual_values: torch.Tensor,
               rows: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-precision keys and values [B, Hkv, max(lengths), D] of cache rows `rows` holding `lengths` tokens: the
    PyTorch path's copy (the C kernel reads the codes in place)."""
    q, ring = quantized, residual_keys.shape[2]
    n = int(lengths.max())
    device, dtype = residual_keys.device, residual_keys.dtype
    token = torch.arange(n)
    slots = (token % ring).to(device)
    keys = residual_keys[rows.to(device)][:, :, slots]  # every token from the ring, then the coded ones over it
    values = residual_values[rows.to(device)][:, :, slots]
    kq, vq = int(q.keys_quantized.max()), int(q.values_quantized.max())
    for out, count, decoded in ((keys, q.keys_quantized, _decoded_keys(q, rows, kq, dtype)),
                                (values, q.values_quantized, _decoded_values(q, rows, vq, dtype))):
        if decoded is None:
            continue
        coded = (token[:decoded.shape[2]][None, :] < count[:, None]).to(device)[:, None, :, None]
        out[:, :, :decoded.shape[2]] = torch.where(coded, decoded, out[:, :, :decoded.shape[2]])
    return keys, values


def _decoded_keys(q: QuantizedKV, rows, count: int, dtype):
    if not count:
        return None
    groups = -(-count // q.group)  # whole groups (a row's count past them is masked by the caller)
    codes = q.key_codes[rows, :, :groups]  # [B, Hkv, groups, D, group bytes]
    if q.bits == RAW_BITS:
        return codes.contiguous().view(dtype).transpose(-1, -2).flatten(2, 3)
    x = unpack(codes, q.bits).to(dtype)  # [B, Hkv, groups, D, group]
    scale, zero = q.key_scale[rows, :, :groups], q.key_zero[rows, :, :groups]
    return (x * scale[..., None] + zero[..., None]).transpose(-1, -2).flatten(2, 3)


def _decoded_values(q: QuantizedKV, rows, count: int, dtype):
    if not count:
        return None
    codes = q.value_codes[rows, :, :count]
    if q.bits == RAW_BITS:
        return codes.contiguous().view(dtype)
    x = unpack(codes, q.bits).to(dtype).view(*codes.shape[:3], -1, q.value_group)
    scale, zero = q.value_scale[rows, :, :count], q.value_zero[rows, :, :count]
    return (x * scale[..., None] + zero[..., None]).flatten(3)
