"""A KV cache streamed layer by layer from three tiers, as FlexGen holds it.

The cache is a set of per-layer arrays (keys and values; H2O adds each slot's score and position), each
[rows, heads, capacity, *tail]. Every layer's arrays are cut along rows x heads, in whole rows (FlexGen's rule:
kvlib.memory.placement.kv_split), into a device, a host and a disk segment; a segment is stored token-major
([capacity, its rows x heads, record]), so the first `n` tokens of a segment are one run of bytes, as in FlexGen's
(seq_len, batch x heads, head_dim) layout. A record is a token of one (row, head): its raw bytes, or its 4-bit codes
with their fp16 scales and minima (kvlib.memory.quant4), on whatever tier it lies.

The rows are cut into groups of `group_rows` consecutive rows, FlexGen's GPU batches (the whole batch, one group, unless
a policy asks for micro-batches); each group is its own unit of every layer, cut into tiers and laid out on them by
itself, as FlexGen keeps a cache per GPU batch. A pass visits (layer, group) units layer by layer, each layer's groups
in turn: FlexGen's zig-zag over a block of GPU batches, whose layer weights are loaded once for all of them
(kvlib.models.llama_forward runs each layer on each micro-batch in turn).

Compute reads a unit from a staging buffer on the device ([group_rows, heads, capacity, *tail], the layout a policy
reads in place, a group's rows at 0.. in order). Two are kept per array: while one unit computes in one, the next unit
of the pass (the next group of this layer, or the next layer's first) is loaded into the other by a copy thread
(FlexGen's overlap of the next load with this compute), and what a unit wrote is stored back to its tiers after it.
So the device holds two micro-batches' cache of one layer, not the batch's. One copy thread runs every load and store
in the order they were asked for, so a load always sees the stores before it. A cache wholly on the device and
uncompressed is not streamed: the policy computes on it in place (a group is a view of its rows).

Every byte moved is counted per direction (kvlib.memory.disk.Transfers): a host segment's load is host->device, a disk
segment's disk->host then host->device; a store the reverse. Device segments move nothing across tiers. A 4-bit
cache's encoding and decoding are timed apart from the copies (kv_encode_s, kv_decode_s). On CUDA the copy thread's
copies run on a side stream from pinned memory (kvlib.memory.disk.CopyStream).
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from time import perf_counter as perf_now

import torch

from kvlib.memory import quant4
from kvlib.memory.disk import CopyStream, OffloadFolder, Transfers
from kvlib.memory.placement import TIERS, kv_split


@dataclass(frozen=True)
class CacheArray:
    name: str
    tail: tuple[int, ...]  # (head_dim,) for keys and values, () for a per-slot number
    dtype: torch.dtype
    fill: float | int = 0
    compress: bool = False  # 4-bit codes (keys and values under --compress-cache)

    @property
    def record_bytes(self) -> int:
        if self.compress:
            return quant4.record_bytes(self.tail[-1])
        return math.prod(self.tail) * torch.empty((), dtype=self.dtype).element_size()

    def to_records(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., *tail] -> [..., record] uint8."""
        if self.compress:
            return quant4.encode(x)
        lead = x.shape[:x.dim() - len(self.tail)]
        return x.contiguous().reshape(*lead, -1).view(torch.uint8)

    def from_records(self, r: torch.Tensor) -> torch.Tensor:
        if self.compress:
            return quant4.decode(r, self.tail[-1], self.dtype)
        return r.contiguous().view(self.dtype).reshape(*r.shape[:-1], *self.tail)


@dataclass
class Group:
    """A micro-batch: rows [first, first + rows), its rows x heads cut into tiers (segments: tier -> [b, e) of its own
    (row x head)s, row-major), its disk records at `disk_before` records' width into each layer's disk block."""
    first: int
    rows: int
    segments: dict[str, tuple[int, int]]
    disk_before: int

    def size(self, tier: str) -> int:
        b, e = self.segments[tier]
        return e - b


def groups_of(rows: int, heads: int, group_rows: int, kv_percents: tuple[float, float]) -> list[Group]:
    """The batch's rows cut into groups of group_rows (the last may be smaller), each group's rows x heads cut into
    tiers by FlexGen's KV_DEV and KV_HOST percents (kvlib.memory.placement.kv_split: whole rows)."""
    out, disk_before = [], 0
    for first in range(0, rows, group_rows):
        n = min(group_rows, rows - first)
        dev, host, disk = kv_split(n, heads, *kv_percents)
        segments = {"device": (0, dev), "host": (dev, dev + host), "disk": (dev + host, n * heads)}
        out.append(Group(first, n, segments, disk_before))
        disk_before += disk
    return out


class TieredKV:
    def __init__(self, arrays: list[CacheArray], layers: int, groups: list[Group], heads: int, capacity: int,
                 device: torch.device, transfers: Transfers, folder: OffloadFolder | None):
        """groups: the batch's rows and their tiers (groups_of)."""
        self.arrays = {a.name: a for a in arrays}
        rows = sum(g.rows for g in groups)
        self.layers, self.rows, self.heads, self.capacity, self.device = layers, rows, heads, capacity, device
        self.transfers = transfers
        self.groups, self.group_rows = groups, groups[0].rows
        # whether each (row x head) of the batch lies in a tier, [rows x heads] bool (what booking sums over)
        self.flats_on = {tier: torch.zeros(rows * heads, dtype=torch.bool) for tier in TIERS}
        for g in groups:
            for tier, (b, e) in g.segments.items():
                self.flats_on[tier][g.first * heads + b:g.first * heads + e] = True
        on = {tier: int(flats.sum()) for tier, flats in self.flats_on.items()}
        self.disk_flats = on["disk"]
        self.resident = on["host"] == 0 and on["disk"] == 0 and not any(a.compress for a in arrays)
        if self.resident:  # the policy's own layout, computed on in place
            self.home = {a.name: [torch.full((rows, heads, capacity, *a.tail), a.fill, dtype=a.dtype, device=device)
                                  for _ in range(layers)] for a in arrays}
            return
        if on["disk"] and folder is None:
            raise ValueError("a disk segment needs an offload folder")
        self.home = {}
        self.files = {}
        for a in arrays:
            fill = a.to_records(torch.full((1, *a.tail), a.fill, dtype=a.dtype))[0]
            for tier, where in (("device", device), ("host", torch.device("cpu"))):
                self.home[a.name, tier] = [[fill.to(where).expand(capacity, g.size(tier), -1).clone()
                                            if g.size(tier) else None for g in self.groups] for _ in range(layers)]
            if on["disk"]:  # preallocated zeros: a slot read before it is written (past a shorter row) is finite
                self.files[a.name] = folder.file(f"{a.name}.bin", layers * self.layer_disk_bytes(a))
        self.staging = {a.name: [torch.full((self.group_rows, heads, capacity, *a.tail), a.fill, dtype=a.dtype,
                                            device=device) for _ in range(2)] for a in arrays}
        self.copy = CopyStream(device)
        self.copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlib-kv-copy")
        self.pending: dict[int, Future] = {}
        self.stores: list[Future] = []
        self.schedule: list[tuple[int, int, int]] = []  # the pass's units in order: (layer, group, tokens to load)
        self.unit: dict[tuple[int, int], int] = {}  # (layer, group) -> its place in the schedule

    # -- sizes ---------------------------------------------------------------------------------------------------
    def place(self, row: int) -> tuple[int, int]:
        """The row's group, and its index among the group's rows."""
        return divmod(row, self.group_rows)

    def layer_disk_bytes(self, a: CacheArray) -> int:
        return self.capacity * self.disk_flats * a.record_bytes

    def disk_offset(self, a: CacheArray, layer: int, group: Group) -> int:
        """Where a unit's disk records start: layers one after another, a layer's groups one after another, each
        group's records token-major."""
        return layer * self.layer_disk_bytes(a) + self.capacity * group.disk_before * a.record_bytes

    def tier_bytes(self, tier: str, tokens_per_flat: torch.Tensor | None = None) -> int:
        """Bytes a tier holds over every layer: its whole reservation, or, given [rows x heads] token counts, what
        those tokens take."""
        per_token = sum(a.record_bytes for a in self.arrays.values()) * self.layers
        flats = self.flats_on[tier]
        if tokens_per_flat is None:
            return self.capacity * int(flats.sum()) * per_token
        return int(tokens_per_flat[flats].sum()) * per_token

    def tensors(self, tier: str) -> list[torch.Tensor]:
        """Every tensor the store holds in a tier (device: its segments and the staging buffers)."""
        if self.resident:
            return [t for homes in self.home.values() for t in homes] if tier == "device" else []
        out = [t for (_, where), homes in self.home.items() if where == tier
               for per_group in homes for t in per_group if t is not None]
        if tier == "device":
            out += [t for bufs in self.staging.values() for t in bufs]
        return out

    def staging_bytes(self) -> int:
        if self.resident:
            return 0
        return sum(t.nbytes for bufs in self.staging.values() for t in bufs)

    # -- loads ---------------------------------------------------------------------------------------------------
    def begin_pass(self, parts: list[tuple[int, int]]) -> None:
        """A forward pass starts over these (group, tokens) parts: each group's rows read their first `tokens` from
        the tiers (the rest of a row is written by the pass itself, or never read). The pass visits every layer's
        parts in this order; the first unit starts loading."""
        self.schedule = [(layer, g, n) for layer in range(self.layers) for g, n in parts]
        self.unit = {(layer, g): i for i, (layer, g, _) in enumerate(self.schedule)}
        if not self.resident:
            self.prefetch(0)

    def prefetch(self, i: int) -> None:
        if not self.resident and 0 <= i < len(self.schedule) and i not in self.pending:
            self.pending[i] = self.copy.submit(self.copier, self._load, i, *self.schedule[i])

    def layer(self, layer: int, group: int) -> dict[str, torch.Tensor]:
        """A unit's arrays on the device, [its group's rows, heads, capacity, *tail] (the group's rows at 0.., in
        order); starts loading the pass's next unit."""
        g = self.groups[group]
        if self.resident:
            return {name: homes[layer][g.first:g.first + g.rows] for name, homes in self.home.items()}
        i = self.unit[layer, group]
        self.prefetch(i)
        self.pending.pop(i).result()
        self.prefetch(i + 1)
        return {name: bufs[i % 2][:g.rows] for name, bufs in self.staging.items()}

    @torch.inference_mode(False)
    def _load(self, i: int, layer: int, group: int, length: int) -> None:
        """Unit i's first `length` tokens into its staging buffer (a copy job: after the compute before it, which
        used the buffer last). The copy is timed as host->device, 4-bit decoding apart (kv_decode_s)."""
        if length == 0:
            return
        g = self.groups[group]
        for a in self.arrays.values():
            flat = self._staged(i, g, a)
            for tier, (b, e) in g.segments.items():
                if e == b:
                    continue
                if tier == "disk":
                    raw = self.files[a.name].read(self.disk_offset(a, layer, g), length * (e - b) * a.record_bytes)
                    records = torch.from_numpy(raw).view(length, e - b, a.record_bytes)
                else:
                    records = self.home[a.name, tier][layer][group][:length]
                if not a.compress:
                    into = flat[b:e, :length]
                    values = a.from_records(records).transpose(0, 1)
                    if tier == "device":
                        into.copy_(values)
                    else:
                        self.copy.into(into, values, self.transfers)
                    continue
                if tier != "device":
                    records = self.copy.to_device(records, self.device, self.transfers)
                t = perf_now()
                flat[b:e, :length] = a.from_records(records).transpose(0, 1)
                self.copy.sync()
                self.transfers.add_apart("kv_decode_s", perf_now() - t)

    # -- stores --------------------------------------------------------------------------------------------------
    def store_range(self, layer: int, group: int, names, begin: int, end: int,
                    rows: tuple[int, int] | None = None) -> None:
        """After a unit's compute: tokens [begin, end) of the group's rows rows=(first, last+1) (counted from the
        group's first; all by default) go back to their tiers."""
        if self.resident or end <= begin:
            return
        r0, r1 = rows or (0, self.groups[group].rows)
        self.stores.append(self.copy.submit(self.copier, self._store_range, (self.unit[layer, group], layer, group),
                                            list(names), begin, end, r0 * self.heads, r1 * self.heads))

    def store_points(self, layer: int, group: int, names, flats: torch.Tensor, slots: torch.Tensor) -> None:
        """After a unit's compute: one token, slots[i], of the group's (row x head) flats[i], for each i, back to its
        tier."""
        if self.resident or len(flats) == 0:
            return
        self.stores.append(self.copy.submit(self.copier, self._store_points, (self.unit[layer, group], layer, group),
                                            list(names), flats.cpu().clone(), slots.cpu().clone()))

    @staticmethod
    def _segments_of(g: Group, f0: int, f1: int):
        """(tier, lo, hi): the group's (row x head)s [f0, f1) cut where the tiers' segments are."""
        for tier, (b, e) in g.segments.items():
            lo, hi = max(b, f0), min(e, f1)
            if lo < hi:
                yield tier, lo, hi

    def _staged(self, i: int, g: Group, a: CacheArray) -> torch.Tensor:
        """The staging buffer of unit i (of group g) of array a as [the group's rows x heads, capacity, *tail]."""
        return self.staging[a.name][i % 2][:g.rows].view(g.rows * self.heads, self.capacity, *a.tail)

    def _records(self, a: CacheArray, x: torch.Tensor) -> torch.Tensor:
        """x as records on the device, 4-bit encoding timed apart (kv_encode_s)."""
        t = perf_now()
        records = a.to_records(x)
        if a.compress:
            self.copy.sync()
            self.transfers.add_apart("kv_encode_s", perf_now() - t)
        return records

    @torch.inference_mode(False)
    def _store_range(self, unit, names, begin, end, f0, f1):
        i, layer, group = unit
        g = self.groups[group]
        for name in names:
            a = self.arrays[name]
            flat = self._staged(i, g, a)
            for tier, lo, hi in self._segments_of(g, f0, f1):
                records = self._records(a, flat[lo:hi, begin:end]).transpose(0, 1)  # [T, hi - lo, record]
                self._put(layer, group, a, tier, lo, hi, begin, records)

    @torch.inference_mode(False)
    def _store_points(self, unit, names, flats, slots):
        i, layer, group = unit
        g = self.groups[group]
        order = torch.argsort(slots * (g.rows * self.heads) + flats)  # token-major: neighbours on disk together
        flats, slots = flats[order], slots[order]
        for name in names:
            a = self.arrays[name]
            records = self._records(a, self._staged(i, g, a)[flats.to(self.device), slots.to(self.device)])
            j = 0
            while j < len(flats):  # runs of consecutive (row x head)s at one slot: one write each
                k = j + 1
                while k < len(flats) and slots[k] == slots[j] and flats[k] == flats[k - 1] + 1:
                    k += 1
                lo, hi, slot = int(flats[j]), int(flats[k - 1]) + 1, int(slots[j])
                for tier, s_lo, s_hi in self._segments_of(g, lo, hi):
                    self._put(layer, group, a, tier, s_lo, s_hi, slot, records[j + s_lo - lo:j + s_hi - lo][None])
                j = k

    def _put(self, layer, group, a: CacheArray, tier, lo, hi, begin, records):
        """records [T, hi - lo, record] into tokens begin.. of the group's (row x head)s lo..hi, all in one tier."""
        g = self.groups[group]
        b, e = g.segments[tier]
        if tier == "device":
            self.home[a.name, tier][layer][group][begin:begin + len(records), lo - b:hi - b] = records.to(self.device)
            return
        t = perf_now()
        records = records.cpu()
        self.transfers.add("device_to_host", records.nbytes, perf_now() - t)
        if tier == "host":
            self.home[a.name, tier][layer][group][begin:begin + len(records), lo - b:hi - b] = records
            return
        f, seg = self.files[a.name], e - b
        base = self.disk_offset(a, layer, g)
        data = records.numpy()
        if hi - lo == seg:  # whole token rows of the segment: one run
            f.write(base + begin * seg * a.record_bytes, data)
            return
        for t_i in range(len(records)):
            f.write(base + ((begin + t_i) * seg + lo - b) * a.record_bytes, data[t_i])

    # -- pass boundaries -----------------------------------------------------------------------------------------
    def settle(self, folder: OffloadFolder | None) -> None:
        """After a pass: every store done, and what was written flushed to the disk and out of the page cache."""
        if self.resident:
            return
        for future in [*self.stores, *self.pending.values()]:
            future.result()  # (raises what went wrong in the copy thread)
        self.stores, self.pending = [], {}
        if folder is not None:
            folder.settle()

    def close(self) -> None:
        if not self.resident:
            self.copier.shutdown(wait=True, cancel_futures=True)
        self.home = {}
        self.staging = {}
