"""kvlib's CPU kernels on each vector path (csrc/vectors.h: AVX-512's 16 floats, AVX's 8, a portable 4, chosen at build
time): every path this CPU runs is built here (kvlib.kernels.library.X86_PATHS) and runs the same cases through the
same wrappers as the default build (-march=native). Each path does the 16-lane logical vectors' operations in the same
order, so where it fuses a x b + c as the default build does, every output is the default build's, bit for bit; the
one that cannot (x86-64's SSE2 baseline has no FMA) is held to the plain references instead, as every path is."""

from __future__ import annotations

import dataclasses
import platform
import random
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from attention_cases import LAYOUTS, random_case, reference
from kernel_cases import kivi_call  # tests/ is on sys.path, as for ray_fakes
from selection_cases import quest_case

from kvlib.kernels import cpu_kernel, library
from kvlib.kernels.decode import DecodeReads, decode_attention
from kvlib.kernels.quantized import BITS, RAW_BITS, QuantizedKV

needs_kernel = pytest.mark.skipif(not cpu_kernel.available(), reason="no C compiler: the kernel is not built")
EXPECTED = {"avx512": ("avx512", 16, True), "avx2": ("avx2", 8, True), "portable+fma": ("portable", 4, True),
            "avx": ("avx", 8, False), "portable": ("portable", 4, False)}  # each of X86_PATHS' isa, width, fma


def decode_cases() -> dict:
    """Every layout, groups up to 16, head dims 16 to 256, lengths across jobs, with and without probabilities, and
    SmolLM2's shape (3 KV heads of 3 query heads, head dim 64) at 1,024 tokens."""
    rng = random.Random(11)
    torch.manual_seed(11)
    cases = {}
    for i in range(20):
        query, reads, per_row = random_case(rng, LAYOUTS[i % len(LAYOUTS)])
        reads.probs = i % 2 == 0
        cases[f"decode {i} {LAYOUTS[i % len(LAYOUTS)]}"] = (query, reads, per_row)
    keys, values = (torch.randn(4, 3, 1024, 64) for _ in range(2))
    lengths = torch.tensor([1024, 700, 257, 1])
    per_row = [([keys[b, h] for h in range(3)], [values[b, h] for h in range(3)], [torch.arange(int(n))] * 3)
               for b, n in enumerate(lengths)]
    reads = DecodeReads(keys, values, lengths, rows=torch.arange(4), probs=True)
    cases["decode SmolLM2"] = (torch.randn(4, 9, 1, 64) * 3, reads, per_row)
    return cases


def quantized_case(bits: int, group: int, value_group: int) -> tuple[torch.Tensor, DecodeReads]:
    """Three rows of 3 KV heads of 3 query heads, head dim 64, whose oldest tokens are codes of every kind: keys in
    groups of LANES' multiples (scored from the codes) or not (dequantized), values in groups that fill a vector or
    not."""
    n_rows, heads, dim, ring, capacity = 3, 3, 64, 64, 640
    scales = 0 if bits == RAW_BITS else dim
    key_shape = (n_rows, heads, capacity // group, dim, group * bits // 8)
    if bits == RAW_BITS:
        key_codes = torch.randn(*key_shape[:4], group).view(torch.uint8)
        value_codes = torch.randn(n_rows, heads, capacity, dim).view(torch.uint8)
    else:
        key_codes = torch.randint(0, 256, key_shape, dtype=torch.uint8)
        value_codes = torch.randint(0, 256, (n_rows, heads, capacity, dim * bits // 8), dtype=torch.uint8)
    top = 2 ** bits - 1 if bits != RAW_BITS else 1
    lengths = torch.tensor([600, 300, 65])
    coded = QuantizedKV(key_codes, torch.rand(n_rows, heads, capacity // group, scales) * 4 / top,
                        torch.randn(n_rows, heads, capacity // group, scales), value_codes,
                        torch.rand(n_rows, heads, capacity, scales // value_group) * 4 / top,
                        torch.randn(n_rows, heads, capacity, scales // value_group),
                        keys_quantized=(lengths - ring).clamp(min=0) // group * group,
                        values_quantized=(lengths - ring).clamp(min=0), bits=bits, group=group,
                        value_group=value_group)
    ring_keys, ring_values = (torch.randn(n_rows, heads, ring, dim) for _ in range(2))
    return torch.randn(3, 9, 1, dim), DecodeReads(ring_keys, ring_values, lengths, rows=torch.tensor([2, 0, 1]),
                                                  quantized=coded)


def selection_cases() -> dict:
    """Quest's selection (head dims 64 and 128, and 48: an odd multiple of LANES), InfiniGen's over random scores (the
    ranks follow every bit), KIVI's store."""
    rng = random.Random(12)
    torch.manual_seed(12)
    cases = {f"quest {i}": quest_case(rng) for i in range(6)}
    odd = quest_case(rng)
    cases["quest dim 48"] = {**odd, **{k: odd[k][..., :48].contiguous() for k in ("query", "key_min", "key_max")}}
    infinigen = {"query": torch.randn(3, 2, 3, 26), "keys": torch.randn(4, 2, 26, 1100),
                 "rows": torch.tensor([3, 0, 1]), "cached": torch.tensor([1099, 40, 17]),
                 "cap": torch.tensor([100, 30, 5]), "scale": 0.2, "alpha": 4.0, "width": 101}
    kivi = kivi_call()
    for name in ("key_ring", "value_ring"):
        kivi[name].normal_()
    return {**cases, "infinigen": infinigen, "kivi": kivi}


def layer_cases() -> dict:
    torch.manual_seed(13)
    angles = torch.rand(3, 32) * 100
    gate_up = torch.randn(4, 2 * 1536) * 8
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -1e-30])
    return {"norm": (torch.randn(5, 576) * 3, torch.randn(5, 576), torch.randn(576)),
            "rope": (torch.randn(3, 7 * 64), torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)),
            "silu": gate_up}


def all_cases() -> dict:
    quantized = {f"quantized {bits} bits, groups {group}, {vg}": quantized_case(bits, group, vg)
                 for bits in (*BITS, RAW_BITS) for group, vg in ((32, 16), (8, 8))}
    return {"decode": decode_cases(), "quantized": quantized, "selection": selection_cases(), "layer": layer_cases()}


@pytest.fixture(scope="module")
def cases() -> dict:
    return all_cases()


def outputs(lib, cases: dict) -> dict[str, list[torch.Tensor]]:
    """Every case's outputs through kvlib's wrappers, with lib as the loaded library."""
    out = {}
    with mock.patch.object(cpu_kernel, "_library", lambda: lib):
        for name, (query, reads, _) in cases["decode"].items():
            attended, probs = decode_attention("c", query, reads, query.shape[-1] ** -0.5)
            out[name] = [attended] + ([probs] if reads.probs else [])
        for name, (query, reads) in cases["quantized"].items():
            out[name] = [decode_attention("c", query, reads, 0.125)[0]]
        for name, case in cases["selection"].items():
            if name == "kivi":
                case = {k: v.clone() if torch.is_tensor(v) else v for k, v in case.items()}  # written in place
                coded = case["coded"] = dataclasses.replace(case["coded"], **{
                    f.name: getattr(case["coded"], f.name).clone() for f in dataclasses.fields(QuantizedKV)
                    if torch.is_tensor(getattr(case["coded"], f.name))})
                cpu_kernel.kivi_store(**case)
                out[name] = [case["key_ring"], case["value_ring"], coded.key_codes, coded.key_scale,
                             coded.value_codes, coded.value_scale]
            else:
                call = cpu_kernel.quest_select if name.startswith("quest") else cpu_kernel.infinigen_select
                out[name] = list(call(**case))
        x, delta, weight = cases["layer"]["norm"]
        x = x.clone()
        normed = cpu_kernel.add_rms_norm(x, delta, weight, 1e-5)
        out["norm"] = [normed, x, cpu_kernel.add_rms_norm(x, None, weight, 1e-5)]
        x, cos, sin = cases["layer"]["rope"]
        x = x.clone()
        cpu_kernel.rope_(x, 5, 64, cos, sin)
        out["rope"] = [x]
        out["silu"] = [cpu_kernel.silu_mul(cases["layer"]["silu"])]
    return out


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32) if x.dtype == torch.float32 else x


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def assert_near_the_references(got: dict, cases: dict) -> None:
    """Decode against a float64 reference, the layer ops against PyTorch's."""
    for name, (query, reads, per_row) in cases["decode"].items():
        expected, expected_probs = reference(query, per_row, query.shape[-1] ** -0.5)
        torch.testing.assert_close(got[name][0].double(), expected, atol=1e-4, rtol=1e-4, msg=name)
        if reads.probs:
            n = expected_probs.shape[-1]
            torch.testing.assert_close(got[name][1][..., :n].double(), expected_probs, atol=1e-4, rtol=1e-4, msg=name)
    x, delta, weight = cases["layer"]["norm"]
    torch.testing.assert_close(got["norm"][0], F.rms_norm(x + delta, (576,), weight, 1e-5), atol=1e-5, rtol=1e-5)
    x, cos, sin = cases["layer"]["rope"]
    rotated = rotate(x[:, :5 * 64].view(3, 5, 64), cos[:, None], sin[:, None]).flatten(1)
    torch.testing.assert_close(got["rope"][0], torch.cat([rotated, x[:, 5 * 64:]], 1), atol=1e-5, rtol=1e-5)
    gate, up = cases["layer"]["silu"].chunk(2, -1)
    torch.testing.assert_close(got["silu"][0], F.silu(gate) * up, atol=1e-5, rtol=1e-5)


def runs_here(path: str) -> bool:
    return platform.machine() in ("x86_64", "AMD64") and library.runs_here(library.X86_PATHS[path])


@pytest.fixture(scope="module")
def built(cases):
    """A path's library and outputs (None: the default build), each built and run once."""
    memo = {}

    def get(path: str | None):
        if path not in memo:
            lib = cpu_kernel._library() if path is None else library.load(library.build(library.X86_PATHS[path]))
            memo[path] = lib, outputs(lib, cases)
        return memo[path]
    return get


@needs_kernel
def test_the_default_build_reports_the_path_it_compiled_for_and_meets_the_references(cases, built):
    lib, got = built(None)
    assert cpu_kernel.instruction_set() == library.describe(lib)  # what a machine probe prints
    assert (lib.isa, lib.width, lib.lanes) in {("avx512", 16, 16), ("avx2", 8, 16), ("avx", 8, 16),
                                               ("portable", 4, 16)}
    assert_near_the_references(got, cases)


@needs_kernel
@pytest.mark.parametrize("path", list(library.X86_PATHS))
def test_each_path_gives_the_bits_of_every_build_that_rounds_as_it_does(path, cases, built):
    """Against the default build where both fuse a x b + c or both do not; else against another path that rounds as
    this one does (avx and portable, both without FMA, where the default build has it)."""
    if not runs_here(path):
        pytest.skip(f"this CPU does not run {path} ({' '.join(library.X86_PATHS[path])})")
    lib, got = built(path)
    assert (lib.isa, lib.width, lib.fma) == EXPECTED[path]
    assert lib.lanes == built(None)[0].lanes  # callers' widths: the same multiples on every path
    assert_near_the_references(got, cases)
    peer = None if lib.fma == built(None)[0].fma else next(
        p for p in library.X86_PATHS if p != path and EXPECTED[p][2] == lib.fma and runs_here(p))
    for name, want in built(peer)[1].items():
        for i, (a, b) in enumerate(zip(got[name], want)):
            assert torch.equal(bits(a), bits(b)), (f"{path} against {peer or 'the default build'}, {name}, output "
                                                   f"{i}: {(a != b).sum()} elements differ")
