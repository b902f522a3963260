"""InfiniGen's host gather, measured: what picking a step's selected entries out of a large host tier costs.

At Llama-3.1-8B's KV shape (8 KV heads, head_dim 128; 30 sparse layers of 32, InfiniGen's first 2 dense) with a
10,240-token context, batch 1 (fp32 on a CPU, fp16 on CUDA, as the engine stores each), for each head 10, 20 and 30 %
of the tokens (random positions, in position order) are picked, and measured three ways:

1. gather, from one layer's keys (each call the next layer's: from memory, not a warm cache): kvlib's former way
   (an advanced index `host_k[i][r, heads, idx]`, a new pageable tensor each time),
   `torch.nn.functional.embedding` over the layer's [B x Hkv x tokens, D] entries (a new tensor too), and
   `torch.index_select(..., out=)` into a preallocated buffer (kvlib's way now: InfiniGenPolicy._gather); per gathered
   entry (one row of D values) and per byte gathered;
2. loop: a decode step's fetches as kvlib issues them, layer after layer (the fetch count read on the host, `.item()`,
   as each layer's selection syncs it; then InfiniGenPolicy._gather and _copy, keys and values), against one gather
   of every layer's entries at once and one copy: the same bytes, so the difference is what the per-layer loop
   costs. Also at 16 tokens a head, where that fixed cost is nearly all.
3. on CUDA only, the copy apart: the gathered entries copied to the device from the new pageable tensor and from the
   pinned buffer (non-blocking on a side stream, then waited for).

Each figure: min / median / max over --repeats, after one warm-up. Writes benchmarks/results/infinigen_gather.json (or
--out); toy sizes under KVLIB_BENCH_SMOKE=1.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from smoke import results_path, sized

from kvlib.memory.ledger import NoLedger
from kvlib.models.loading import ModelSpec
from kvlib.policies import make_policy
from kvlib.study.machine import machine

SHARES = (0.1, 0.2, 0.3)
SMALL = 16  # tokens a head: a fetch whose per-layer fixed cost dominates


def spread(seconds: list[float]) -> dict:
    return {"min": min(seconds), "median": statistics.median(seconds), "max": max(seconds)}


def timed(fn, repeats: int, sync) -> dict:
    fn()  # warm-up: first-touch allocations, the allocator's caches
    seconds = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        seconds.append(time.perf_counter() - start)
    return spread(seconds)


def picks(batch: int, heads: int, tokens: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """width distinct positions per (row, head), in position order (as kvlib's C selection returns them)."""
    return torch.rand((batch, heads, tokens), generator=gen).topk(width, dim=-1).indices.sort(dim=-1).values


def policy_over(host_k, host_v, device, stream):
    """An InfiniGen policy holding the given host tier, fetching to `device`: _gather and _copy as the engine calls
    them."""
    layers, _, heads, _, dim = host_k.shape
    policy = make_policy("infinigen", fetch=True)
    policy.spec = ModelSpec("gather", layers + 2, 4 * heads, heads, dim, 4 * heads * dim, host_k.shape[3],
                            host_k.dtype)
    policy.device, policy.host_k, policy.host_v, policy.stream = device, host_k, host_v, stream
    policy.staging = policy.copied = None
    policy.ledger = NoLedger()
    return policy


class Tier:
    """The sparse layers' host tier, keys and values [layers, B, Hkv, tokens, D], and where it is copied to."""

    def __init__(self, shape: tuple, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
        # written, not zeros: a calloc'd tier would be the kernel's one zero page, read from cache
        self.k = torch.empty(shape, dtype=dtype).uniform_(generator=gen)
        self.v = torch.empty_like(self.k).uniform_(generator=gen)
        self.layers, self.batch, self.heads, self.tokens, self.dim = shape
        self.device, self.cuda = device, device.type == "cuda"
        self.sync = torch.cuda.synchronize if self.cuda else (lambda: None)
        self.rows = torch.arange(self.batch)
        self.heads_index = torch.arange(self.heads)[None, :, None]
        self.entry_bytes = self.dim * self.k.element_size()

    def flat(self, idx: torch.Tensor) -> torch.Tensor:
        """Picks idx [B, Hkv, W] as rows of one layer's [B x Hkv x tokens, D] entries."""
        return ((self.rows[:, None, None] * self.heads + self.heads_index) * self.tokens + idx).reshape(-1)


def gather_ways(tier: Tier, idx: torch.Tensor, share: float, repeats: int) -> list[dict]:
    """One layer's keys gathered each way; each call from the next layer, so that its rows come from memory, not
    from the cache the last call left them in."""
    layers = itertools.cycle(range(tier.layers))
    flat, r = tier.flat(idx), tier.rows[:, None, None]
    out = torch.empty((flat.numel(), tier.dim), dtype=tier.k.dtype)
    ways = {"advanced index (new tensor)": lambda: tier.k[next(layers)][r, tier.heads_index, idx],
            "embedding (new tensor)": lambda: F.embedding(flat, tier.k[next(layers)].view(-1, tier.dim)),
            "index_select out= (reused buffer)":
                lambda: torch.index_select(tier.k[next(layers)].view(-1, tier.dim), 0, flat, out=out)}
    n = flat.numel()
    figures = []
    for way, fn in ways.items():
        t = timed(fn, repeats, lambda: None)
        figures.append({"share": share, "way": way, "entries": n, "bytes": n * tier.entry_bytes, **t,
                        "ns_per_entry": 1e9 * t["median"] / n, "gb_per_s": n * tier.entry_bytes / t["median"] / 1e9})
    return figures


def copies(tier: Tier, idx: torch.Tensor, share: float, repeats: int) -> list[dict]:
    """CUDA only: the gathered keys copied to the device from the new pageable tensor and from a pinned buffer, on a
    side stream."""
    pageable = tier.k[tier.layers // 2][tier.rows[:, None, None], tier.heads_index, idx]
    pinned = torch.empty(pageable.shape, dtype=pageable.dtype, pin_memory=True).copy_(pageable)
    side = torch.cuda.Stream()

    def from_pinned():
        with torch.cuda.stream(side):
            pinned.to(tier.device, non_blocking=True)

    figures = []
    for source, fn in (("pageable", lambda: pageable.to(tier.device)), ("pinned, side stream", from_pinned)):
        t = timed(fn, repeats, tier.sync)
        figures.append({"share": share, "from": source, "bytes": pageable.nbytes, **t,
                        "gb_per_s": pageable.nbytes / t["median"] / 1e9})
    return figures


def loops(tier: Tier, idx: torch.Tensor, share: float | None, repeats: int) -> list[dict]:
    """A step's fetches layer after layer, as kvlib issues them, against one fused gather and copy of the same
    entries."""
    width = idx.shape[-1]
    table = idx.expand(tier.layers, *idx.shape)  # the same picks each layer: equal bytes either way
    count = torch.full((tier.batch,), width, device=tier.device)  # on the device: reading it on the host syncs
    policy = policy_over(tier.k, tier.v, tier.device, torch.cuda.Stream() if tier.cuda else None)

    def per_layer():
        for i in range(tier.layers):
            w = int(count.max().item())
            policy._copy(*policy._gather(i, tier.rows, table[i][..., :w]))

    # every layer's picks as one flat index into the whole tier [layers x B x Hkv x tokens, D]
    base = torch.arange(tier.layers)[:, None] * (tier.batch * tier.heads * tier.tokens)
    flat = (base + torch.stack([tier.flat(t) for t in table])).reshape(-1)
    fused_k = torch.empty((flat.numel(), tier.dim), dtype=tier.k.dtype, pin_memory=tier.cuda)
    fused_v = torch.empty((flat.numel(), tier.dim), dtype=tier.k.dtype, pin_memory=tier.cuda)

    def fused():
        count.max().item()  # the one sync a fused fetch would keep
        for host, buffer in ((tier.k, fused_k), (tier.v, fused_v)):
            torch.index_select(host.view(-1, tier.dim), 0, flat, out=buffer)
            buffer.to(tier.device, non_blocking=True)

    moved = 2 * flat.numel() * tier.entry_bytes
    figures = []
    for way, fn in (("per layer (kvlib's fetch)", per_layer), ("fused (one gather, all layers)", fused)):
        t = timed(fn, repeats, tier.sync)
        figures.append({"share": share, "tokens_per_head": width, "way": way, "bytes": moved, **t,
                        "per_layer_us": 1e6 * t["median"] / tier.layers})
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=sized(5, 2))
    parser.add_argument("--threads", type=int, default=None, help="PyTorch's CPU threads (default: its own; 1 on a "
                        "shared machine, where a parallel gather waits for a descheduled thread)")
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON (default: "
                        "benchmarks/results/infinigen_gather.json; a temporary folder under KVLIB_BENCH_SMOKE=1)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    load = os.getloadavg()
    tier = Tier(sized((30, 1, 8, 10_240, 128), (2, 1, 2, 256, 16)), dtype, device, gen)
    figures = {"device": str(device), "cpu": machine()["machine_cpu"],
               "cpu_threads": torch.get_num_threads(), "load_avg_before": load,
               "gpu": torch.cuda.get_device_name() if tier.cuda else None,
               "shape": {"sparse_layers": tier.layers, "batch": tier.batch, "kv_heads": tier.heads,
                         "tokens": tier.tokens, "head_dim": tier.dim, "dtype": str(dtype).removeprefix("torch."),
                         "host_tier_gb": 2 * tier.k.nbytes / 1e9},
               "repeats": args.repeats, "gather": [], "copy": [], "loop": []}
    for share in (*SHARES, None):
        width = SMALL if share is None else max(1, int(share * tier.tokens))
        idx = picks(tier.batch, tier.heads, tier.tokens, width, gen)
        if share is not None:
            figures["gather"] += gather_ways(tier, idx, share, args.repeats)
            if tier.cuda:
                figures["copy"] += copies(tier, idx, share, args.repeats)
        figures["loop"] += loops(tier, idx, share, args.repeats)
    figures["load_avg_after"] = os.getloadavg()
    out = args.out or results_path("infinigen_gather.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=1))
    print_table(figures)


def print_table(figures: dict) -> None:
    s = figures["shape"]
    print(f"{figures['device']} ({figures['cpu']}, {figures['cpu_threads']} threads): {s['sparse_layers']} layers x "
          f"batch {s['batch']} x {s['kv_heads']} KV heads x {s['tokens']} tokens x {s['head_dim']} {s['dtype']}, "
          f"host tier {s['host_tier_gb']:.2f} GB; load {figures['load_avg_before'][0]:.2f} before, "
          f"{figures['load_avg_after'][0]:.2f} after; ms min / median / max over {figures['repeats']}")
    print("\ngather, one layer's keys")
    print(f"{'share':>5} {'way':<36} {'entries':>8} {'ms min/med/max':>22} {'ns/entry':>9} {'GB/s':>6}")
    for g in figures["gather"]:
        print(f"{g['share']:>5} {g['way']:<36} {g['entries']:>8} {ms(g):>22} {g['ns_per_entry']:>9.1f} "
              f"{g['gb_per_s']:>6.2f}")
    print("\na step's fetches, keys and values, every sparse layer")
    print(f"{'share':>5} {'way':<32} {'MB':>7} {'ms min/med/max':>22} {'us/layer':>9}")
    for g in figures["loop"]:
        share = g["share"] if g["share"] is not None else f"{g['tokens_per_head']}t"
        print(f"{share:>5} {g['way']:<32} {g['bytes'] / 1e6:>7.1f} {ms(g):>22} {g['per_layer_us']:>9.1f}")
    for c in figures["copy"]:
        print(f"copy {c['share']} from {c['from']}: {ms(c)} ms, {c['gb_per_s']:.1f} GB/s")


def ms(t: dict) -> str:
    return f"{1e3 * t['min']:.2f} / {1e3 * t['median']:.2f} / {1e3 * t['max']:.2f}"


if __name__ == "__main__":
    main()
