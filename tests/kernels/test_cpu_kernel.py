"""kvlib's C decode-attention kernel: the same attention as SDPA over each row's own keys, wherever they lie, and the
same greedy tokens as PyTorch's kernels in the engine. It builds wherever there is a C compiler (CI has gcc); where it
cannot, the engine falls back to PyTorch (tested here too)."""

import platform
import subprocess
import warnings

import pytest
import torch
import torch.nn.functional as F

from kvlib.engine import Engine
from kvlib.kernels import cpu_kernel, library
from kvlib.kernels.decode import DecodeReads, decode_attention
from kvlib.policies import make_policy

needs_kernel = pytest.mark.skipif(not cpu_kernel.available(), reason="no C compiler: the kernel is not built")


def c_kernel(query, reads, scale):
    return decode_attention("c", query, reads, scale)[0]


def sdpa_over_rows(query, keys_of_row, values_of_row, scale):
    """SDPA of each query row over its own keys/values [Hkv, n, D]."""
    return torch.cat([F.scaled_dot_product_attention(query[r:r + 1], k[None], v[None], scale=scale, enable_gqa=True)
                      for r, (k, v) in enumerate(zip(keys_of_row, values_of_row))])


@needs_kernel
@pytest.mark.parametrize("block_size", [4, 16, 512])
@pytest.mark.parametrize("kv_heads, group, head_dim", [(3, 3, 64), (2, 1, 16), (1, 8, 128)])
def test_paged_decode_equals_sdpa_over_each_row(block_size, kv_heads, group, head_dim):
    """Rows of 1 token, of a chunk's length and one past it (the kernel splits rows into jobs of 256 tokens), of
    several chunks, over scattered blocks, two rows sharing a prefix's blocks."""
    torch.manual_seed(0)
    chunk = 256
    lengths = [1, chunk, chunk + 1, 3 * chunk + 17, block_size + 2, 70]
    needs = [-(-n // block_size) for n in lengths]
    blocks = sum(needs) + 3
    order = torch.randperm(blocks).tolist()
    tables = [[order.pop() for _ in range(n)] for n in needs]
    tables[4][:1] = tables[3][:1]  # row 4 shares row 3's first block
    width = max(needs)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    pool_k, pool_v = (torch.randn(kv_heads, blocks * block_size, head_dim) for _ in range(2))
    query = torch.randn(len(lengths), kv_heads * group, 1, head_dim)
    scale = head_dim ** -0.5
    out = c_kernel(query, DecodeReads(pool_k, pool_v, torch.tensor(lengths), table=table, block_size=block_size), scale)
    slots = [(torch.tensor(t)[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
             for t, n in zip(tables, lengths)]
    expected = sdpa_over_rows(query, [pool_k[:, s] for s in slots], [pool_v[:, s] for s in slots], scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_a_per_row_cache_is_read_in_place_for_any_of_its_rows():
    """Query row b attends cache row rows[b] (any order, a subset) over its own length: no padding, no copy."""
    torch.manual_seed(1)
    kv_heads, group, d, capacity = 2, 2, 32, 600
    keys, values = (torch.randn(5, kv_heads, capacity, d) for _ in range(2))
    rows, lengths = torch.tensor([4, 0, 2]), torch.tensor([600, 1, 257])
    query = torch.randn(3, kv_heads * group, 1, d)
    out = c_kernel(query, DecodeReads(keys, values, lengths, rows=rows), 0.2)
    expected = sdpa_over_rows(query, [keys[r, :, :n] for r, n in zip(rows, lengths)],
                              [values[r, :, :n] for r, n in zip(rows, lengths)], 0.2)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_the_kernel_refuses_what_it_cannot_read():
    keys = torch.randn(2, 2, 8, 16)
    with pytest.raises(ValueError, match="int64"):
        c_kernel(torch.randn(1, 2, 1, 16), DecodeReads(keys, keys, torch.tensor([3]),
                                                       rows=torch.tensor([0], dtype=torch.int32)), 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        c_kernel(torch.randn(1, 2, 1, 16), DecodeReads(keys.transpose(2, 3), keys, torch.tensor([3]),
                                                       rows=torch.tensor([0])), 1.0)
    assert not cpu_kernel.supports("cpu", torch.bfloat16, 2, 64)
    assert not cpu_kernel.supports("cpu", torch.float32, 2, 24)  # not a multiple of the kernel's vector width


@needs_kernel
@pytest.mark.parametrize("policy, settings", [("full", {}), ("paged", {}), ("infinigen", {"budget": 0.3})])
def test_the_engine_decodes_the_same_with_the_kernel_and_with_pytorch(tiny, mixed_prompts, policy, settings,
                                                                      monkeypatch):
    """A mixed batch, 12 greedy tokens: the same tokens and, step by step, logits within fp32 rounding (InfiniGen
    below its budget: its selection in C and in PyTorch, then the index lists read in place)."""
    def run():
        logits = []
        kv = make_policy(policy, **settings)
        engine = Engine(tiny, kv)
        with engine.session(prompt_lens=[len(p) for p in mixed_prompts], max_new_tokens=12) as s:
            tokens = [int(s.prefill(r, p, "fused").argmax()) for r, p in enumerate(mixed_prompts)]
            generated = [tokens]
            for _ in range(11):
                logits.append(s.decode(list(range(len(mixed_prompts))), tokens))
                tokens = logits[-1].argmax(-1).tolist()
                generated.append(tokens)
        return generated, torch.stack(logits), kv.decode_kernel

    tokens, logits, ran = run()
    monkeypatch.setenv(cpu_kernel.KERNEL_ENV, "torch")
    torch_tokens, torch_logits, torch_ran = run()
    assert (ran, torch_ran) == ("c", "torch")
    assert tokens == torch_tokens
    torch.testing.assert_close(logits, torch_logits, atol=1e-4, rtol=1e-4)


def test_without_a_compiler_decode_falls_back_to_pytorch(tiny, mixed_prompts, monkeypatch, tmp_path):
    monkeypatch.setenv("KVLIB_CACHE", str(tmp_path))  # nothing built there
    monkeypatch.setenv("CC", "/bin/false")
    cpu_kernel._library.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert not cpu_kernel.available()
        assert any("could not be built" in str(w.message) for w in caught)
        result = Engine(tiny, make_policy("paged")).generate(mixed_prompts, 4, stop_at_eos=False)
        assert all(len(o["token_ids"]) == 4 for o in result.outputs) and result.stats["decode_attention"] == "torch"
    finally:
        cpu_kernel._library.cache_clear()


@needs_kernel
def test_loading_the_kernel_leaves_subnormals_alone():
    """A shared library built with -ffast-math turns on flush-to-zero for the whole process that loads it: every
    policy's arithmetic would change with it."""
    assert cpu_kernel.available()
    assert torch.tensor(1e-40, dtype=torch.float32).item() != 0.0
    assert torch.tensor(1e-40, dtype=torch.float32) * 1.0 != 0


@needs_kernel
@pytest.mark.parametrize("path", ["native", *(library.X86_PATHS if platform.machine() in ("x86_64", "AMD64") else [])])
def test_the_sources_compile_without_a_warning(path):
    """-Wall -Wextra (in the build's flags) clean, each source on its own, for this CPU and, on x86, for each of
    vectors.h's paths (a vector wider than the target once changed the ABI: -Wpsabi)."""
    target = None if path == "native" else library.X86_PATHS[path]
    assert {"-Wall", "-Wextra"} <= set(library.flags(target))
    for source in [p for p in library.SOURCES if p.suffix == ".c"]:
        done = subprocess.run([*library.compiler(), "-fsyntax-only", "-Werror", *library.flags(target), str(source)],
                              capture_output=True, text=True, check=False)
        assert done.returncode == 0, f"{source.name}:\n{done.stderr}"


ARM = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics\n" \
      "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\nCPU part\t: {part}\nCPU revision\t: 1\n"


def test_the_build_is_keyed_by_the_compiler_and_the_cpu_on_every_architecture(monkeypatch):
    """Two ARM machines (whose /proc/cpuinfo has no "model name" or "flags") or two compilers never share a build."""
    neoverse, cortex = library.cpu_lines(ARM.format(part="0xd0c")), library.cpu_lines(ARM.format(part="0xd08"))
    assert "Features" in neoverse and neoverse != cortex
    keys = set()
    for version, cpu in (("gcc 12", neoverse), ("gcc 13", neoverse), ("gcc 12", cortex)):
        monkeypatch.setattr(library, "_output", lambda command, version=version: version)
        monkeypatch.setattr(library, "cpu_lines", lambda text, cpu=cpu: cpu)
        keys.add(library.build_key(["/usr/bin/cc"]))
    keys.add(library.build_key(["/usr/local/bin/cc"]))  # the last one's version and CPU, another compiler path
    assert len(keys) == 4
