"""InfiniGen's selection in C (kvlib.kernels.cpu_kernel.infinigen_select) against the PyTorch path it replaces on a
CPU (InfiniGenPolicy._select): the same picks per row, the same set per (row, KV head), the new token after them,
over random layouts and equal scores; and its refusals of what it cannot read."""

import random

import pytest
import torch
from selection_cases import select

from kvlib.kernels import cpu_kernel

needs_kernel = pytest.mark.skipif(not cpu_kernel.available(), reason="no C compiler: the kernel is not built")


def random_case(rng: random.Random, ties: bool = False) -> dict:
    """One sparse layer's selection as the policy holds it: partial keys for a few more cache rows than the batch,
    rows of 1 token to ~3 vector widths past a thousand, a budget and an alpha from one candidate to all. Values are
    multiples of 1/4 (or small integers, with ties), so every score is exact in fp32 in any summation order: the two
    paths rank the same numbers."""
    batch, kv_heads, group = rng.randint(1, 5), rng.randint(1, 4), rng.choice([1, 2, 3, 7])
    r, capacity = rng.choice([1, 3, 13, 26]), rng.choice([40, 300, 1100])
    cache_rows = batch + rng.randint(0, 2)
    levels = 3 if ties else 16
    keys = torch.randint(-levels, levels + 1, (cache_rows, kv_heads, r, capacity)).float() / (1 if ties else 4)
    query = torch.randint(-levels, levels + 1, (batch, kv_heads, group, r)).float() / (1 if ties else 4)
    rows = torch.tensor(rng.sample(range(cache_rows), batch))
    cached = torch.tensor([rng.choice([1, 2, 17, rng.randint(1, capacity - 1), capacity - 1]) for _ in range(batch)])
    return {"query": query, "keys": keys, "rows": rows, "cached": cached, "budget": rng.choice([0.05, 0.3, 1.0]),
            "alpha": rng.choice([0.0, 0.5, 4.0, 1e9])}


def picks(table: torch.Tensor, count: torch.Tensor) -> list[list[list[int]]]:
    return [[sorted(table[b, h, :int(count[b])].tolist()) for h in range(table.shape[1])] for b in range(len(count))]


@needs_kernel
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("ties", [False, True])
def test_the_c_selection_equals_the_pytorch_path(seed, ties):
    rng = random.Random(seed)
    for i in range(25):
        case = random_case(rng, ties)
        table, count = select(case, "c")
        want_table, want_count = select(case, "torch")
        assert torch.equal(count, want_count), (seed, i)
        assert picks(table, count) == picks(want_table, want_count), (seed, i)
        for b, n in enumerate(count.tolist()):
            cached = int(case["cached"][b])
            assert 1 <= n <= cached, (seed, i)
            assert (table[b, :, n] == cached).all() and (want_table[b, :, n] == cached).all(), (seed, i)
            assert (table[b, :, n:] == cached).all()  # past the picks, the new token: in the cache's row
            for h in range(table.shape[1]):
                assert table[b, h, :n].tolist() == sorted(set(table[b, h, :n].tolist()))  # position order, distinct


@needs_kernel
def test_equal_scores_go_to_the_earlier_token():
    """Every score equal (zero keys): each head picks the row's first tokens."""
    rng = random.Random(3)
    for _ in range(10):
        case = random_case(rng)
        case["keys"].zero_()
        table, count = select(case, "c")
        for b, n in enumerate(count.tolist()):
            assert (table[b, :, :n] == torch.arange(n)).all()
        assert picks(table, count) == picks(*select(case, "torch"))


@needs_kernel
@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(cached=c["cached"].clone().fill_(c["keys"].shape[-1])), "1 <= cached < capacity"),
    (lambda c: c.update(cached=c["cached"].clone().fill_(0)), "1 <= cached < capacity"),
    (lambda c: c.update(rows=c["rows"].clone().fill_(c["keys"].shape[0])), "out of range"),
    (lambda c: c.update(width=1), "width must be in"),
    (lambda c: c.update(cap=c["cap"].clone().fill_(c["width"])), "1 <= cap < width"),
    (lambda c: c.update(query=c["query"].double()), "query must be torch.float32"),
    (lambda c: c.update(rows=c["rows"].int()), "rows must be torch.int64"),
    (lambda c: c.update(keys=c["keys"][:, :, :-1].contiguous()), "keys must have shape"),
])
def test_the_c_selection_refuses_what_it_cannot_read(change, message):
    case = random_case(random.Random(8))
    call = {"query": case["query"], "keys": case["keys"], "rows": case["rows"], "cached": case["cached"],
            "cap": case["cached"].clone(), "scale": 0.125, "alpha": 4.0, "width": int(case["cached"].max()) + 1}
    change(call)
    with pytest.raises(ValueError, match=message):
        cpu_kernel.infinigen_select(**call)
