"""Malformed inputs for every C entry point, through the public wrappers (kvlib.kernels.cpu_kernel), each a valid
call with one thing broken: run as a script (tests/kernels/test_kernel_inputs.py runs it in a subprocess, so that a
crash fails the cases instead of ending the run), it prints one JSON line per case it is given: what the call raised, or
"ok". Cases named `valid ...` are the unbroken calls, which must run."""

from __future__ import annotations

import json
import sys
import traceback

import torch

from kvlib.kernels import cpu_kernel
from kvlib.kernels.quantized import QuantizedKV

HUGE = 2 ** 62  # an index that, multiplied by a block or a head dim, overflows int64
PAST_INT64 = 2 ** 64 + 1  # what ctypes would wrap to 1


def meta(x: torch.Tensor) -> torch.Tensor:
    """x on PyTorch's meta device: a tensor with no memory, standing in for a GPU tensor here."""
    return torch.empty(x.shape, dtype=x.dtype, device="meta")


def every_other(x: torch.Tensor) -> torch.Tensor:
    """x's values in a view whose last dimension is not contiguous."""
    return torch.stack([x, x], dim=-1)[..., 0]


# -- valid calls ------------------------------------------------------------------------------------------------------
def decode_call() -> dict:
    """Two rows of a per-row cache [B, Hkv, 16, 16], 2 query heads a KV head, 5 tokens read."""
    keys = torch.randn(2, 2, 16, 16)
    return {"query": torch.randn(2, 4, 1, 16), "keys": keys, "values": torch.randn(2, 2, 16, 16),
            "row_offset": torch.arange(2) * keys.stride(0), "table": torch.zeros(2, 1, dtype=torch.int64),
            "lengths": torch.full((2, 2), 5), "block_size": 16, "head_stride": keys.stride(1), "scale": 0.25}


def quantized_decode_call() -> dict:
    """decode_call with each row's first 8 tokens 2-bit codes in a 3-row coded cache."""
    call = decode_call()
    n, h, cap, d, bits, group, vg = 3, 2, 16, 16, 2, 8, 8
    call["quantized"] = QuantizedKV(
        torch.randint(0, 255, (n, h, cap // group, d, group * bits // 8), dtype=torch.uint8),
        torch.rand(n, h, cap // group, d), torch.rand(n, h, cap // group, d),
        torch.randint(0, 255, (n, h, cap, d * bits // 8), dtype=torch.uint8),
        torch.rand(n, h, cap, d // vg), torch.rand(n, h, cap, d // vg), torch.tensor([8, 8]), torch.tensor([8, 8]),
        bits, group, vg)
    call["rows"] = torch.tensor([0, 2])
    call["table"] = torch.zeros(2, 1, dtype=torch.int64)
    return call


def quest_call() -> dict:
    """Two rows over a pool of 6 blocks of 16, 2 KV heads of 2 query heads, 2 pages each."""
    return {"query": torch.randn(2, 4, 1, 16), "key_min": torch.randn(6, 2, 16) - 1, "key_max": torch.randn(6, 2, 16) + 1,
            "table": torch.tensor([[0, 1, 2], [3, 4, 5]]), "row_blocks": torch.tensor([3, 2]),
            "pages": torch.tensor([2, 2]), "seen": torch.tensor([40, 20]), "block_size": 16, "width": 2}


def infinigen_call() -> dict:
    """Two rows reading cache rows 1 and 0 of 3, 2 KV heads of 2 query heads, 4 partial channels, 32 tokens."""
    return {"query": torch.randn(2, 2, 2, 4), "keys": torch.randn(3, 2, 4, 32), "rows": torch.tensor([1, 0]),
            "cached": torch.tensor([20, 7]), "cap": torch.tensor([4, 4]), "scale": 0.5, "alpha": 2.0, "width": 8}


def kivi_call(d: int = 16) -> dict:
    """Two rows into a 3-row cache of 16 tokens: 2-bit codes, groups of 8, a ring of 8."""
    n, h, cap, bits, group, vg = 3, 2, 16, 2, 8, 8
    coded = QuantizedKV(torch.zeros(n, h, cap // group, 16, group * bits // 8, dtype=torch.uint8),
                        torch.zeros(n, h, cap // group, 16), torch.zeros(n, h, cap // group, 16),
                        torch.zeros(n, h, cap, 16 * bits // 8, dtype=torch.uint8), torch.zeros(n, h, cap, 16 // vg),
                        torch.zeros(n, h, cap, 16 // vg), None, None, bits, group, vg)
    return {"key": torch.randn(2, h, d), "value": torch.randn(2, h, d), "rows": torch.tensor([0, 2]),
            "begin": torch.tensor([3, 9]), "key_ring": torch.zeros(n, h, 8, d), "value_ring": torch.zeros(n, h, 8, d),
            "coded": coded, "residual": 8}


def norm_call() -> dict:
    return {"x": torch.randn(3, 32), "delta": torch.randn(3, 32), "weight": torch.rand(32), "eps": 1e-6}


def rope_call() -> dict:
    return {"x": torch.randn(2, 3, 96), "heads": 3, "head_dim": 32, "cos": torch.rand(2, 3, 32),
            "sin": torch.rand(2, 3, 32)}


CALLS = {"decode": (decode_call, cpu_kernel.decode), "quantized decode": (quantized_decode_call, cpu_kernel.decode),
         "quest_select": (quest_call, cpu_kernel.quest_select),
         "infinigen_select": (infinigen_call, cpu_kernel.infinigen_select),
         "kivi_store": (kivi_call, cpu_kernel.kivi_store), "add_rms_norm": (norm_call, cpu_kernel.add_rms_norm),
         "rope_": (rope_call, cpu_kernel.rope_),
         "silu_mul": (lambda: {"gate_up": torch.randn(3, 64)}, cpu_kernel.silu_mul)}


def put(name, value):
    return lambda c: c.update({name: value(c) if callable(value) else value})


def setitem(name, index, value):
    return lambda c: c[name].__setitem__(index, value)


def coded(field, value):
    return lambda c: setattr(c.get("quantized") or c["coded"], field, value(c.get("quantized") or c["coded"]))


def narrowed(*fields):
    """The codes' `fields` one float wide in the last dimension (the C sizes them from the head dim)."""
    def change(c):
        q = c.get("quantized") or c["coded"]
        for field in fields:
            setattr(q, field, getattr(q, field)[..., :1].clone())
    return change


# (entry point, what is broken, the change): each must raise ValueError
BROKEN = [
    ("decode", "query of rank 3", put("query", lambda c: c["query"][:, :, 0])),
    ("decode", "query of 2 tokens", put("query", lambda c: c["query"].expand(-1, -1, 2, -1))),
    ("decode", "query of 0 tokens", put("query", lambda c: c["query"][:, :, :0])),
    ("decode", "query fp64", put("query", lambda c: c["query"].double())),
    ("decode", "query on another device", put("query", lambda c: meta(c["query"]))),
    ("decode", "query with a head dim of 0", put("query", lambda c: c["query"][..., :0])),
    ("decode", "query heads not a multiple of the KV heads", put("query", lambda c: c["query"][:, :3])),
    ("decode", "lengths with no KV head", put("lengths", lambda c: c["lengths"][:, :0])),
    ("decode", "keys on another device", put("keys", lambda c: meta(c["keys"]))),
    ("decode", "keys non-contiguous", put("keys", lambda c: every_other(c["keys"]))),
    ("decode", "keys fp64", put("keys", lambda c: c["keys"].double())),
    ("decode", "values of another shape", put("values", lambda c: c["values"][:1])),
    ("decode", "a table of rank 1", put("table", lambda c: c["table"][:, 0])),
    ("decode", "a [B, Hkv] table read per head", lambda c: c.update(per_head_table=True)),
    ("decode", "a table int32", put("table", lambda c: c["table"].int())),
    ("decode", "a table non-contiguous", put("table", lambda c: torch.zeros(2, 2, dtype=torch.int64)[:, :1])),
    ("decode", "a table on another device", put("table", lambda c: meta(c["table"]))),
    ("decode", "a table entry past the cache", setitem("table", (1, 0), 2)),
    ("decode", "a negative table entry", setitem("table", (1, 0), -1)),
    ("decode", "a table entry that overflows", setitem("table", (1, 0), HUGE)),
    ("decode", "a negative length", setitem("lengths", (0, 1), -1)),
    ("decode", "a length past the table", setitem("lengths", (0, 1), 17)),
    ("decode", "lengths of another batch", put("lengths", lambda c: c["lengths"][:1])),
    ("decode", "a negative row offset", setitem("row_offset", 1, -16)),
    ("decode", "a row offset that overflows", setitem("row_offset", 1, HUGE)),
    ("decode", "row offsets of another batch", put("row_offset", lambda c: c["row_offset"][:1])),
    ("decode", "a block size of 0", put("block_size", 0)),
    ("decode", "a block size past int64", put("block_size", PAST_INT64)),
    ("decode", "a negative head stride", put("head_stride", -256)),
    ("decode", "a head stride past int64", put("head_stride", 2 ** 63)),
    ("decode", "a NaN scale", put("scale", float("nan"))),
    ("quantized decode", "key scales of another width", coded("key_scale", lambda q: q.key_scale[..., :1].clone())),
    ("quantized decode", "value scales of another width", coded("value_scale", lambda q: q.value_scale[..., :1].clone())),
    ("quantized decode", "key scales and zeros of another width", narrowed("key_scale", "key_zero")),
    ("quantized decode", "value scales and zeros of another width", narrowed("value_scale", "value_zero")),
    ("quantized decode", "key zeros of another width", coded("key_zero", lambda q: torch.rand(3, 2, 2, 32))),
    ("quantized decode", "codes for another head dim", coded("value_codes", lambda q: q.value_codes[..., :2].clone())),
    ("quantized decode", "codes on another device", coded("key_codes", lambda q: meta(q.key_codes))),
    ("quantized decode", "scales on another device", coded("value_zero", lambda q: meta(q.value_zero))),
    ("quantized decode", "coded counts on another device", coded("keys_quantized", lambda q: meta(q.keys_quantized))),
    ("quantized decode", "rows on another device", put("rows", lambda c: meta(c["rows"]))),
    ("quantized decode", "a row past the codes", setitem("rows", 1, 3)),
    ("quantized decode", "a negative row", setitem("rows", 1, -1)),
    ("quantized decode", "no rows", put("rows", None)),
    ("quantized decode", "keys coded in part of a group", coded("keys_quantized", lambda q: torch.tensor([8, 4]))),
    ("quantized decode", "a coded count past the capacity", coded("values_quantized", lambda q: torch.tensor([8, 17]))),
    ("quantized decode", "3-bit codes", coded("bits", lambda q: 3)),
    ("quantized decode", "a group of 0", coded("group", lambda q: 0)),
    ("quest_select", "query of 2 tokens", put("query", lambda c: c["query"].expand(-1, -1, 2, -1))),
    ("quest_select", "query of rank 2", put("query", lambda c: c["query"][:, :, 0, 0])),
    ("quest_select", "query on another device", put("query", lambda c: meta(c["query"]))),
    ("quest_select", "query heads not a multiple of the KV heads", put("query", lambda c: c["query"][:, :3])),
    ("quest_select", "key bounds on another device", put("key_min", lambda c: meta(c["key_min"]))),
    ("quest_select", "key bounds non-contiguous", put("key_max", lambda c: every_other(c["key_max"]))),
    ("quest_select", "key bounds of another shape", put("key_max", lambda c: c["key_max"][:5])),
    ("quest_select", "key bounds fp64", put("key_min", lambda c: c["key_min"].double())),
    ("quest_select", "a table of rank 1", put("table", lambda c: c["table"][0])),
    ("quest_select", "a table entry past the pool", setitem("table", (0, 1), 6)),
    ("quest_select", "a negative table entry", setitem("table", (1, 0), -1)),
    ("quest_select", "a last table entry past the pool", setitem("table", (1, 2), HUGE)),
    ("quest_select", "row_blocks 0", setitem("row_blocks", 0, 0)),
    ("quest_select", "row_blocks past the table", setitem("row_blocks", 0, 4)),
    ("quest_select", "pages 0", setitem("pages", 1, 0)),
    ("quest_select", "seen past the last block", setitem("seen", 1, 33)),
    ("quest_select", "seen in the block before the last", setitem("seen", 1, 16)),
    ("quest_select", "a width below the pages", put("width", 1)),
    ("quest_select", "a width past int64", put("width", PAST_INT64)),
    ("quest_select", "a block size of 0", put("block_size", 0)),
    ("quest_select", "an empty batch with a table of width 0", lambda c: c.update(
        query=c["query"][:0], table=c["table"][:0, :0], row_blocks=c["row_blocks"][:0], pages=c["pages"][:0],
        seen=c["seen"][:0])),
    ("infinigen_select", "query on another device", put("query", lambda c: meta(c["query"]))),
    ("infinigen_select", "query of rank 3", put("query", lambda c: c["query"][:, 0])),
    ("infinigen_select", "query with no channel", put("query", lambda c: c["query"][..., :0])),
    ("infinigen_select", "keys of rank 3", put("keys", lambda c: c["keys"][0])),
    ("infinigen_select", "keys on another device", put("keys", lambda c: meta(c["keys"]))),
    ("infinigen_select", "keys non-contiguous", put("keys", lambda c: every_other(c["keys"]))),
    ("infinigen_select", "keys of other heads", put("keys", lambda c: c["keys"][:, :1].contiguous())),
    ("infinigen_select", "keys of one token", put("keys", lambda c: c["keys"][..., :1].contiguous())),
    ("infinigen_select", "a row past the cache", setitem("rows", 0, 3)),
    ("infinigen_select", "a negative row", setitem("rows", 0, -1)),
    ("infinigen_select", "rows on another device", put("rows", lambda c: meta(c["rows"]))),
    ("infinigen_select", "cached 0", setitem("cached", 1, 0)),
    ("infinigen_select", "cached at the capacity", setitem("cached", 1, 32)),
    ("infinigen_select", "a cap at the width", setitem("cap", 1, 8)),
    ("infinigen_select", "a cap of 0", setitem("cap", 1, 0)),
    ("infinigen_select", "a width of 1", put("width", 1)),
    ("infinigen_select", "a width past int64", put("width", PAST_INT64)),
    ("infinigen_select", "a NaN alpha", put("alpha", float("nan"))),
    ("infinigen_select", "cached int32", put("cached", lambda c: c["cached"].int())),
    ("kivi_store", "key scales of another width (writes past them)", coded("key_scale", lambda q: q.key_scale[..., :1].clone())),
    ("kivi_store", "key scales and zeros of another width", narrowed("key_scale", "key_zero")),
    ("kivi_store", "value scales and zeros of another width", narrowed("value_scale", "value_zero")),
    ("kivi_store", "value scales of another width", coded("value_scale", lambda q: q.value_scale[..., :1].clone())),
    ("kivi_store", "a key of another head dim than the codes", lambda c: c.update(kivi_call(d=32), coded=c["coded"])),
    ("kivi_store", "codes on another device", coded("value_codes", lambda q: meta(q.value_codes))),
    ("kivi_store", "key on another device", put("key", lambda c: meta(c["key"]))),
    ("kivi_store", "key fp64", put("key", lambda c: c["key"].double())),
    ("kivi_store", "key non-contiguous", put("key", lambda c: every_other(c["key"]))),
    ("kivi_store", "value of another batch", put("value", lambda c: c["value"][:1])),
    ("kivi_store", "key of rank 2", put("key", lambda c: c["key"][0])),
    ("kivi_store", "a ring of another shape", put("key_ring", lambda c: c["key_ring"][:, :, :4])),
    ("kivi_store", "a ring on another device", put("value_ring", lambda c: meta(c["value_ring"]))),
    ("kivi_store", "a row past the cache", setitem("rows", 1, 3)),
    ("kivi_store", "a negative row", setitem("rows", 1, -1)),
    ("kivi_store", "begin at the capacity", setitem("begin", 1, 16)),
    ("kivi_store", "a negative begin", setitem("begin", 1, -1)),
    ("kivi_store", "a residual not dividing the capacity", put("residual", 24)),
    ("kivi_store", "a residual past int64", put("residual", PAST_INT64)),
    ("kivi_store", "3-bit codes", coded("bits", lambda q: 3)),
    ("add_rms_norm", "a weight fp64", put("weight", lambda c: c["weight"].double())),
    ("add_rms_norm", "a weight of another size", put("weight", lambda c: c["weight"][:16])),
    ("add_rms_norm", "a delta of another shape", put("delta", lambda c: c["delta"][:2])),
    ("add_rms_norm", "a delta on another device", put("delta", lambda c: meta(c["delta"]))),
    ("add_rms_norm", "x on another device", put("x", lambda c: meta(c["x"]))),
    ("add_rms_norm", "x non-contiguous", put("x", lambda c: every_other(c["x"]))),
    ("add_rms_norm", "x of width 24", lambda c: c.update(x=c["x"][:, :24].contiguous(), delta=None,
                                                          weight=c["weight"][:24])),
    ("add_rms_norm", "x of rank 0", put("x", lambda c: torch.tensor(1.0))),
    ("add_rms_norm", "a NaN eps", put("eps", float("nan"))),
    ("rope_", "cos of another head dim", put("cos", lambda c: c["cos"][..., :16])),
    ("rope_", "cos of more rows than x", put("cos", lambda c: torch.rand(3, 3, 32))),
    ("rope_", "sin fp64", put("sin", lambda c: c["sin"].double())),
    ("rope_", "sin on another device", put("sin", lambda c: meta(c["sin"]))),
    ("rope_", "heads x head_dim past the width", put("heads", 4)),
    ("rope_", "a negative heads", put("heads", -1)),
    ("rope_", "a head dim not a multiple of the vectors", put("head_dim", 24)),
    ("rope_", "x non-contiguous", put("x", lambda c: every_other(c["x"]))),
    ("rope_", "x on another device", put("x", lambda c: meta(c["x"]))),
    ("silu_mul", "an odd width", put("gate_up", lambda c: torch.randn(3, 65))),
    ("silu_mul", "a half-width of 8", put("gate_up", lambda c: torch.randn(3, 16))),
    ("silu_mul", "fp64", put("gate_up", lambda c: c["gate_up"].double())),
    ("silu_mul", "on another device", put("gate_up", lambda c: meta(c["gate_up"]))),
    ("silu_mul", "non-contiguous", put("gate_up", lambda c: every_other(c["gate_up"]))),
]

VALID = {f"valid {entry}": (entry, lambda c: None) for entry in CALLS}
VALID["valid decode with an empty batch"] = ("decode", lambda c: c.update(
    query=c["query"][:0], row_offset=c["row_offset"][:0], table=c["table"][:0], lengths=c["lengths"][:0]))
VALID["valid rope_ with cos broadcast over the batch"] = ("rope_", lambda c: c.update(cos=c["cos"][:1],
                                                                                       sin=c["sin"][:1]))
CASES = {**VALID, **{f"{entry}: {what}": (entry, change) for entry, what, change in BROKEN}}


def run(name: str) -> dict:
    entry, change = CASES[name]
    make, call = CALLS[entry]
    kwargs = make()
    change(kwargs)
    try:
        call(**kwargs)
    except Exception as exc:  # noqa: BLE001 (what was raised is the result)
        return {"case": name, "raised": type(exc).__name__, "message": str(exc),
                "traceback": traceback.format_exc(limit=-3)}
    return {"case": name, "raised": None}


if __name__ == "__main__":
    torch.manual_seed(0)
    for name in sys.argv[1:] or CASES:
        print(json.dumps(run(name)), flush=True)
