"""Random cases of the sparse policies' selection kernels, shared by their tests and the kernel-path tests: Quest's
block selection, and an InfiniGen policy holding a case's partial keys."""

import random
from types import SimpleNamespace

import torch

from kvlib.models.loading import ModelSpec
from kvlib.policies import make_policy


def quest_case(rng: random.Random, ties: bool = False) -> dict:
    """One layer's decode step as QuestPolicy.prepare leaves it: rows of 1 to ~40 blocks over a shuffled pool (the
    last block partly filled or full), tables padded with block 0, a page budget a row from 1 block to all."""
    batch, kv_heads = rng.randint(1, 5), rng.randint(1, 4)
    group, dim, bs = rng.choice([1, 2, 3, 4, 7, 8, 16]), rng.choice([64, 128]), rng.choice([1, 4, 16])
    counts = [rng.choice([1, 2, rng.randint(1, 40)]) for _ in range(batch)]
    seen = [(n - 1) * bs + rng.randint(1, bs) for n in counts]
    pages = [rng.choice([1, n, rng.randint(1, n)]) for n in counts]
    pool = sum(counts) + rng.randint(0, 5)
    order = torch.randperm(pool, generator=torch.Generator().manual_seed(rng.randint(0, 2 ** 31))).tolist()
    tables = [[order.pop() for _ in range(n)] for n in counts]
    width = max(counts)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    lo = torch.randn(pool, kv_heads, dim)
    hi = lo + torch.rand(pool, kv_heads, dim)
    if ties:  # every bound equal (0), or equal in pairs: only position decides
        lo, hi = (lo.round(), hi.round()) if rng.random() < 0.5 else (torch.zeros_like(lo), torch.zeros_like(hi))
        if rng.random() < 0.5:
            lo[1::2], hi[1::2] = lo[0:-1:2].clone(), hi[0:-1:2].clone()
    query = torch.randn(batch, kv_heads * group, 1, dim)
    if ties and rng.random() < 0.3:  # a zero query: every bound 0 or -0, which rank equal
        query.zero_()
    return {"query": query, "key_min": lo, "key_max": hi, "table": table, "row_blocks": torch.tensor(counts),
            "pages": torch.tensor(pages), "seen": torch.tensor(seen), "block_size": bs,
            "width": max(min(p, n) for p, n in zip(pages, counts))}


def policy_for(case: dict):
    """An InfiniGen policy holding the case's partial keys as its one sparse layer (layer 1 after one dense)."""
    kv_heads, group = case["query"].shape[1:3]
    policy = make_policy("infinigen", budget=case["budget"], alpha=case["alpha"], dense_layers=1)
    policy.spec = ModelSpec("case", 2, kv_heads * group, kv_heads, 64, 0, 0, torch.float32)
    policy.device, policy.dense, policy.scale = torch.device("cpu"), 1, 0.125
    policy.partial_k = case["keys"][None]
    return policy


def select(case: dict, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    policy = policy_for(case)
    policy.decode_kernel = kernel
    return policy._select(1, case["query"], SimpleNamespace(rows=case["rows"], start=case["cached"]))
