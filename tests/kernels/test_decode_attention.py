"""The decode attention every policy shares (kvlib.kernels.decode): the C kernel and the PyTorch path against a plain
reference over random layouts, the C kernel's refusals of what it cannot read, and every registered policy decoding
through it."""

import random

import pytest
import torch
from attention_cases import LAYOUTS, random_case, reference
from policy_examples import example

from kvlib.engine import Engine
from kvlib.kernels import cpu_kernel
from kvlib.kernels.decode import DecodeReads, decode_attention
from kvlib.kernels.quantized import BITS, RAW_BITS, QuantizedKV, unpack
from kvlib.policies import available, make_policy

needs_kernel = pytest.mark.skipif(not cpu_kernel.available(), reason="no C compiler: the kernel is not built")


@needs_kernel
@pytest.mark.parametrize("seed", range(8))
def test_the_c_kernel_and_the_pytorch_path_equal_a_plain_reference(seed):
    """32 random cases a seed, 256 in all: every layout (a per-row cache or a view of one, block tables per row or
    per row and KV head, index lists into a pool or into a per-row cache), groups up to the kernel's largest, head dims 16 to 256, lengths 0 to three
    jobs, scores of large magnitude, with and without the probability output."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    for case in range(32):
        layout = LAYOUTS[case % len(LAYOUTS)]
        query, reads, per_row = random_case(rng, layout)
        reads.probs = rng.random() < 0.5
        scale = query.shape[-1] ** -0.5
        expected, expected_probs = reference(query, per_row, scale)
        kernels = ["c"] + (["torch"] if int(reads.lengths.min()) > 0 else [])  # a row always holds its new token
        for kernel in kernels:
            out, probs = decode_attention(kernel, query, reads, scale)
            what = f"seed {seed} case {case}: {layout}, {kernel}, query {tuple(query.shape)}, lengths {reads.lengths}"
            torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4, msg=lambda m, what=what: f"{what}\n{m}")
            if reads.probs:
                n = expected_probs.shape[-1]
                assert probs.shape[:2] == expected_probs.shape[:2] and probs.shape[2] >= n, what
                torch.testing.assert_close(probs[..., :n].double(), expected_probs, atol=1e-4, rtol=1e-4,
                                           msg=lambda m, what=what: f"{what}\n{m}")
                assert not probs[..., n:].any(), what
            else:
                assert probs is None


def random_quantized_case(rng: random.Random):
    """A query over rows whose oldest tokens are codes (random bytes: any byte is a valid code) and the rest in a
    residual ring; the keys and values each (row, KV head) reads, dequantized token by token by the layout's rule."""
    bits = rng.choice([*BITS, RAW_BITS])
    group, dim = rng.choice([4, 8, 16, 32, 64]), rng.choice([16, 64, 128])  # 16 up: keys scored a vector of tokens
    value_group, ring = min(rng.choice([8, 16, 32]), dim), group * rng.choice([1, 2])
    batch, heads, q_group = rng.randint(1, 3), rng.randint(1, 3), rng.choice([1, 3, 7])
    lengths = torch.tensor([rng.choice([1, 2, ring, 255, 257, rng.randint(1, 600)]) for _ in range(batch)])
    capacity = -(-int(lengths.max()) // ring) * ring + ring * rng.randint(0, 1)
    n_rows = batch + rng.randint(0, 2)
    rows = torch.tensor(rng.sample(range(n_rows), batch))
    scales = 0 if bits == RAW_BITS else dim
    code_bytes = dim * bits // 8
    key_shape = (n_rows, heads, capacity // group, dim, group * bits // 8)  # each channel's codes along its group
    codes = [torch.randint(0, 256, shape, dtype=torch.uint8) for shape in (key_shape, (*key_shape[:2], capacity,
                                                                             code_bytes))]
    if bits == RAW_BITS:  # each value's own fp32 bytes
        codes = [torch.randn(*key_shape[:4], group).view(torch.uint8),
                 torch.randn(n_rows, heads, capacity, dim).view(torch.uint8)]
    top = 2 ** bits - 1 if bits != RAW_BITS else 1  # a scale spreads the codes over a range of ~1, as min-max's does
    coded = QuantizedKV(codes[0], torch.rand(n_rows, heads, capacity // group, scales) * 4 / top,
                        torch.randn(n_rows, heads, capacity // group, scales), codes[1],
                        torch.rand(n_rows, heads, capacity, scales // value_group) * 4 / top,
                        torch.randn(n_rows, heads, capacity, scales // value_group),
                        keys_quantized=torch.tensor([rng.randint(0, int(n) // group) * group for n in lengths]),
                        values_quantized=torch.tensor([rng.randint(0, int(n)) for n in lengths]),
                        bits=bits, group=group, value_group=value_group)
    ring_keys, ring_values = (torch.randn(n_rows, heads, ring, dim) for _ in range(2))

    def token(kind, b, h, t):
        row = int(rows[b])
        if t >= int(getattr(coded, f"{kind}s_quantized")[b]):
            return (ring_keys if kind == "key" else ring_values)[row, h, t % ring]
        if kind == "key":  # channel c's code of token t: the (t % group)-th along its group
            raw = coded.key_codes[row, h, t // group]
            x = raw.view(torch.float32) if bits == RAW_BITS else unpack(raw, bits).float()
            x = x[:, t % group]
            return x if bits == RAW_BITS else x * coded.key_scale[row, h, t // group] + coded.key_zero[row, h, t // group]
        raw = coded.value_codes[row, h, t]
        if bits == RAW_BITS:
            return raw.view(torch.float32)
        x = unpack(raw, bits).float()
        return (x.view(-1, value_group) * coded.value_scale[row, h, t, :, None]
                + coded.value_zero[row, h, t, :, None]).flatten()

    per_row = []
    for b in range(batch):
        n = int(lengths[b])
        keys = [torch.stack([token("key", b, h, t) for t in range(n)]) for h in range(heads)]
        values = [torch.stack([token("value", b, h, t) for t in range(n)]) for h in range(heads)]
        per_row.append((keys, values, [torch.arange(n)] * heads))
    query = torch.randn(batch, heads * q_group, 1, dim)
    return query, DecodeReads(ring_keys, ring_values, lengths, rows=rows, quantized=coded), per_row


@pytest.mark.parametrize("seed", range(8))
def test_coded_tokens_are_read_in_place_as_dequantized(seed):
    """KIVI's layout, 6 random cases a seed: every code width and the raw bytes, groups, rings, lengths across the
    kernel's jobs and coded counts anywhere in a row; the C kernel reads the codes where they lie, the PyTorch path
    dequantizes a copy, both equal to a reference that dequantizes token by token."""
    rng = random.Random(100 + seed)
    torch.manual_seed(seed)
    for case in range(6):
        query, reads, per_row = random_quantized_case(rng)
        scale = query.shape[-1] ** -0.5
        expected, _ = reference(query, per_row, scale)
        for kernel in ["c", "torch"] if cpu_kernel.available() else ["torch"]:
            out, _ = decode_attention(kernel, query, reads, scale)
            what = f"seed {seed} case {case}: {kernel}, bits {reads.quantized.bits}, lengths {reads.lengths}"
            torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4,
                                       msg=lambda m, what=what: f"{what}\n{m}")


@needs_kernel
def test_a_row_of_length_zero_reads_nothing_and_gets_zeros():
    keys = torch.randn(2, 1, 8, 16)
    out, probs = decode_attention("c", torch.randn(2, 2, 1, 16), DecodeReads(keys, keys, torch.tensor([0, 3]),
                                                                            rows=torch.tensor([0, 1]), probs=True), 0.25)
    assert not out[0].any() and out[1].abs().sum() > 0
    assert not probs[0].any() and probs[1, 0, :3].sum().item() == pytest.approx(2.0)  # two query heads, each sums to 1


@needs_kernel
@pytest.mark.parametrize("what, change, message", [
    ("a group past the kernel's limit", {"group": 17}, "query's 17 heads must be a multiple"),
    ("a head dim past the kernel's limit", {"dim": 272}, "head dim must be a multiple"),
    ("a length past the row's table", {"length": 33}, "length"),
    ("a negative length", {"length": -1}, "length"),
    ("a block past the pool", {"block": 4}, "outside the keys and values"),
    ("a negative block", {"block": -1}, "outside the keys and values"),
])
def test_the_kernel_refuses_what_it_cannot_read(what, change, message):
    group, dim = change.get("group", 2), change.get("dim", 16)
    pool = torch.randn(1, 4 * 16, dim)  # 4 blocks of 16
    table = torch.tensor([[0, change.get("block", 1)]])
    reads = DecodeReads(pool, pool.clone(), torch.tensor([change.get("length", 32)]), table=table, block_size=16)
    with pytest.raises(ValueError, match=message):
        decode_attention("c", torch.randn(1, group, 1, dim), reads, 1.0)


@needs_kernel
@pytest.mark.parametrize("field, value", [("keys_quantized", 40), ("values_quantized", -1)])
def test_the_kernel_refuses_coded_counts_past_the_codes(field, value):
    rng = random.Random(7)
    query, reads, _ = random_quantized_case(rng)
    setattr(reads.quantized, field, torch.full_like(reads.quantized.keys_quantized, value * 1000))
    with pytest.raises(ValueError, match="quantized cache"):
        decode_attention("c", query, reads, 1.0)


def test_every_policy_decodes_through_the_one_kernel_and_at_full_budget_as_full(tiny, kernel):
    torch.manual_seed(3)
    prompts = [torch.randint(100, 5000, (n,)).tolist() for n in (70, 23, 41)]
    ran, outputs = {}, {}
    for name in available():
        policy = make_policy(name, **example(name, "keeps_all", block_size=8))
        mode = "chunked" if "chunked" in policy.supported_prefill else policy.preferred_prefill
        result = Engine(tiny, policy).generate(prompts, 10, prefill_mode=mode, chunk_size=32, stop_at_eos=False)
        ran[name] = result.stats["decode_attention"]
        outputs[name] = [o["token_ids"] for o in result.outputs]
    assert set(ran.values()) == {kernel}, ran
    different = {name: out for name, out in outputs.items() if out != outputs["full"]}
    assert not different, f"full: {outputs['full']}\n{different}"
