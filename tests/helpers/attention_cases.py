"""Random decode-attention cases over every layout the kernel reads, and their float64 reference: the decode
attention's tests and the kernel-path tests read the same ones."""

import random

import torch

from kvlib.kernels.decode import DecodeReads

LAYOUTS = ("rows", "row_tables", "head_tables", "index_lists", "row_index_lists")


def random_case(rng: random.Random, layout: str) -> tuple[torch.Tensor, DecodeReads, list[list[torch.Tensor]]]:
    """A query, what it reads, and the slots each (row, KV head) reads (indices into the keys' token axis)."""
    chunk = 256  # the kernel's job size: lengths around its multiples cross a job boundary
    batch, heads = rng.randint(1, 4), rng.randint(1, 4)
    group = rng.choice([1, 2, 3, 7, 8, 16])
    dim = rng.choice([16, 64, 128, 256])
    lengths = torch.tensor([[rng.choice([0, 1, 2, 15, 16, 17, chunk - 1, chunk, chunk + 1, rng.randint(1, 3 * chunk)])
                             for _ in range(heads)] for _ in range(batch)])
    if layout in ("rows", "row_tables"):  # one length a row, as full's and paged's rows have
        lengths = lengths[:, :1].expand(-1, heads).contiguous()
    longest = int(lengths.max())
    magnitude = rng.choice([1.0, 30.0])  # large scores: the softmax's max subtraction and the merge must hold
    query = torch.randn(batch, heads * group, 1, dim) * magnitude
    if layout == "rows":
        cache_rows = batch + rng.randint(0, 2)
        capacity = max(longest, 1) + rng.randint(0, 40)
        spare = rng.choice([0, 7])  # a view of a longer cache (KIVI's dequantized rows are one)
        keys, values = (torch.randn(cache_rows, heads, capacity + spare, dim)[:, :, :capacity] for _ in range(2))
        rows = torch.tensor(rng.sample(range(cache_rows), batch))
        slots = [[torch.arange(int(n)) for n in lengths[b]] for b in range(batch)]
        reference_keys = [[keys[rows[b], h] for h in range(heads)] for b in range(batch)]
        reference_values = [[values[rows[b], h] for h in range(heads)] for b in range(batch)]
        reads = DecodeReads(keys, values, lengths[:, 0].clone() if rng.random() < 0.5 else lengths, rows=rows)
        return query, reads, list(zip(reference_keys, reference_values, slots))
    if layout == "row_index_lists":  # InfiniGen's selection, read in place: a per-row cache through index lists
        cache_rows, capacity = batch + rng.randint(0, 2), max(longest, 1) + rng.randint(0, 40)
        keys, values = (torch.randn(cache_rows, heads, capacity, dim) for _ in range(2))
        rows = torch.tensor(rng.sample(range(cache_rows), batch))
        table = torch.stack([torch.stack([torch.tensor(rng.sample(range(capacity), max(longest, 1)))
                                          for _ in range(heads)]) for _ in range(batch)])  # [B, Hkv, longest]
        per_row = [([keys[rows[b], h] for h in range(heads)], [values[rows[b], h] for h in range(heads)],
                    [table[b, h, :int(lengths[b, h])] for h in range(heads)]) for b in range(batch)]
        return query, DecodeReads(keys, values, lengths, rows=rows, table=table), per_row
    block_size = 1 if layout == "index_lists" else rng.choice([1, 4, 16, 32])
    width = max(-(-longest // block_size), 1)
    pool_blocks = width * batch * heads + rng.randint(0, 5)
    keys, values = (torch.randn(heads, pool_blocks * block_size, dim) for _ in range(2))
    per_head = layout in ("head_tables", "index_lists")
    table = torch.stack([torch.stack([torch.tensor(rng.sample(range(pool_blocks), width)) for _ in range(heads)])
                         for _ in range(batch)])  # [B, Hkv, W]; a block may be read by several rows (shared)
    if not per_head:
        table = table[:, 0].contiguous()
    per_row = []
    for b in range(batch):
        tables = table[b] if per_head else table[b][None].expand(heads, -1)
        slots = [(tables[h][:, None] * block_size + torch.arange(block_size)).flatten()[:int(lengths[b, h])]
                 for h in range(heads)]
        per_row.append(([keys[h] for h in range(heads)], [values[h] for h in range(heads)], slots))
    reads = DecodeReads(keys, values, lengths if per_head or rng.random() < 0.5 else lengths[:, 0].clone(),
                        table=table, block_size=block_size)
    return query, reads, per_row


def reference(query, per_row, scale):
    """Each (row, KV head)'s query heads attend its slots in float64; probabilities summed over the group."""
    batch, hq, _, dim = query.shape
    heads = len(per_row[0][0])
    group = hq // heads
    out = torch.zeros(batch, hq, 1, dim, dtype=torch.float64)
    longest = max(len(s) for _, _, slots in per_row for s in slots)
    probs = torch.zeros(batch, heads, longest, dtype=torch.float64)
    for b, (keys, values, slots) in enumerate(per_row):
        for h in range(heads):
            if len(slots[h]) == 0:
                continue
            k, v = keys[h][slots[h]].double(), values[h][slots[h]].double()
            q = query[b, h * group:(h + 1) * group, 0].double()
            p = torch.softmax(q @ k.T * scale, dim=-1)  # [G, n]
            out[b, h * group:(h + 1) * group, 0] = p @ v
            probs[b, h, :len(slots[h])] = p.sum(dim=0)
    return out, probs
