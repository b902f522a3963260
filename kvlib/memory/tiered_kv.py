"""A KV cache streamed layer by layer from three tiers, as FlexGen holds it.

The cache is a set of per-layer arrays (keys and values; H2O adds each slot's score and position), each
[rows, heads, capacity, *tail]. Every layer's arrays are cut along rows x heads (kvlib.memory.placement.split_counts)
into a device, a host and a disk segment; a segment is stored token-major ([capacity, its rows x heads, record]), so
the first `n` tokens of a segment are one run of bytes, as in FlexGen's (seq_len, batch x heads, head_dim) layout.
A record is a token of one (row, head): its raw bytes, or its 4-bit codes with their fp16 scales and minima
(kvlib.memory.quant4), on whatever tier it lies.

Compute reads a layer from a staging buffer on the device ([rows, heads, capacity, *tail], the layout a policy reads in
place). Two are kept per array: while layer l computes in one, layer l + 1 is loaded into the other by a copy thread
(FlexGen's overlap of the next layer's load with this layer's compute), and what layer l wrote is stored back to its
tiers after it. One copy thread runs every load and store in the order they were asked for, so a load always sees the
stores before it. A cache wholly on the device and uncompressed is not streamed: the policy computes on it in place.

Every byte moved is counted per direction (kvlib.memory.disk.Transfers): a host segment's load is host->device, a disk
segment's disk->host then host->device; a store the reverse. Device segments move nothing across tiers.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from time import perf_counter as perf_now

import torch

from kvlib.memory import quant4
from kvlib.memory.disk import OffloadFolder, Transfers
from kvlib.memory.placement import split_counts


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


class TieredKV:
    def __init__(self, arrays: list[CacheArray], layers: int, rows: int, heads: int, capacity: int,
                 shares: tuple[float, float, float], device: torch.device, transfers: Transfers,
                 folder: OffloadFolder | None):
        self.arrays = {a.name: a for a in arrays}
        self.layers, self.rows, self.heads, self.capacity, self.device = layers, rows, heads, capacity, device
        self.transfers = transfers
        n = rows * heads
        dev, host, disk = split_counts(n, shares)
        self.segments = {"device": (0, dev), "host": (dev, dev + host), "disk": (dev + host, n)}
        self.resident = host == 0 and disk == 0 and not any(a.compress for a in arrays)
        if self.resident:  # the policy's own layout, computed on in place
            self.home = {a.name: [torch.full((rows, heads, capacity, *a.tail), a.fill, dtype=a.dtype, device=device)
                                  for _ in range(layers)] for a in arrays}
            return
        if disk and folder is None:
            raise ValueError("a disk segment needs an offload folder")
        self.home = {}
        self.files = {}
        for a in arrays:
            fill = a.to_records(torch.full((1, *a.tail), a.fill, dtype=a.dtype))[0]
            for tier, where in (("device", device), ("host", torch.device("cpu"))):
                b, e = self.segments[tier]
                self.home[a.name, tier] = [fill.to(where).expand(capacity, e - b, -1).clone() for _ in range(layers)] \
                    if e > b else None
            if disk:  # preallocated zeros: a slot read before it is written (past a shorter row) is finite
                self.files[a.name] = folder.file(f"{a.name}.bin", layers * self.layer_disk_bytes(a))
        self.staging = {a.name: [torch.full((rows, heads, capacity, *a.tail), a.fill, dtype=a.dtype, device=device)
                                 for _ in range(2)] for a in arrays}
        self.copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlib-kv-copy")
        self.pending: dict[int, Future] = {}
        self.stores: list[Future] = []
        self.length = 0

    # -- sizes ---------------------------------------------------------------------------------------------------
    def segment_size(self, tier: str) -> int:
        b, e = self.segments[tier]
        return e - b

    def layer_disk_bytes(self, a: CacheArray) -> int:
        return self.capacity * self.segment_size("disk") * a.record_bytes

    def tier_bytes(self, tier: str, tokens_per_flat: torch.Tensor | None = None) -> int:
        """Bytes a tier holds over every layer: its whole reservation, or, given [rows x heads] token counts, what
        those tokens take."""
        b, e = self.segments[tier]
        per_token = sum(a.record_bytes for a in self.arrays.values()) * self.layers
        if tokens_per_flat is None:
            return self.capacity * (e - b) * per_token
        return int(tokens_per_flat[b:e].sum()) * per_token

    def tensors(self, tier: str) -> list[torch.Tensor]:
        """Every tensor the store holds in a tier (device: its segment and the staging buffers)."""
        if self.resident:
            return [t for homes in self.home.values() for t in homes] if tier == "device" else []
        out = [t for (_, where), homes in self.home.items() if where == tier and homes is not None for t in homes]
        if tier == "device":
            out += [t for bufs in self.staging.values() for t in bufs]
        return out

    def staging_bytes(self) -> int:
        if self.resident:
            return 0
        return sum(t.nbytes for bufs in self.staging.values() for t in bufs)

    # -- loads ---------------------------------------------------------------------------------------------------
    def begin_pass(self, length: int) -> None:
        """A forward pass starts: each layer's first `length` tokens are what it reads from the tiers (the rest of a
        row is written by the pass itself, or never read); layer 0 starts loading."""
        self.length = length
        if not self.resident:
            self.prefetch(0)

    def prefetch(self, layer: int) -> None:
        if not self.resident and 0 <= layer < self.layers and layer not in self.pending:
            self.pending[layer] = self.copier.submit(self._load, layer, self.length)

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's arrays on the device, [rows, heads, capacity, *tail]; starts loading the next layer."""
        if self.resident:
            return {name: homes[layer] for name, homes in self.home.items()}
        self.prefetch(layer)
        self.pending.pop(layer).result()
        self.prefetch(layer + 1)
        return {name: bufs[layer % 2] for name, bufs in self.staging.items()}

    @torch.inference_mode(False)
    def _load(self, layer: int, length: int) -> None:
        if length == 0:
            return
        for a in self.arrays.values():
            flat = self.staging[a.name][layer % 2].view(self.rows * self.heads, self.capacity, *a.tail)
            for tier in ("device", "host", "disk"):
                b, e = self.segments[tier]
                if e == b:
                    continue
                if tier == "disk":
                    f = self.files[a.name]
                    raw = f.read(layer * self.layer_disk_bytes(a), length * (e - b) * a.record_bytes)
                    records = torch.from_numpy(raw).view(length, e - b, a.record_bytes)
                else:
                    records = self.home[a.name, tier][layer][:length]
                t = perf_now()
                flat[b:e, :length] = a.from_records(records.to(self.device)).transpose(0, 1)
                if tier != "device":
                    self.transfers.add("host_to_device", records.nbytes, perf_now() - t)

    # -- stores --------------------------------------------------------------------------------------------------
    def store_range(self, layer: int, names, begin: int, end: int, flats: tuple[int, int] | None = None) -> None:
        """After a layer's compute: tokens [begin, end) of (row x head)s flats=(first, last+1) (all by default) go
        back to their tiers."""
        if self.resident or end <= begin:
            return
        f0, f1 = flats or (0, self.rows * self.heads)
        self.stores.append(self.copier.submit(self._store_range, layer, list(names), begin, end, f0, f1))

    def store_points(self, layer: int, names, flats: torch.Tensor, slots: torch.Tensor) -> None:
        """After a layer's compute: one token, slots[i], of (row x head) flats[i], for each i, back to its tier."""
        if self.resident or len(flats) == 0:
            return
        self.stores.append(self.copier.submit(self._store_points, layer, list(names), flats.cpu().clone(),
                                              slots.cpu().clone()))

    def _segments_of(self, f0: int, f1: int):
        for tier in ("device", "host", "disk"):
            b, e = self.segments[tier]
            lo, hi = max(b, f0), min(e, f1)
            if lo < hi:
                yield tier, b, e, lo, hi

    @torch.inference_mode(False)
    def _store_range(self, layer, names, begin, end, f0, f1):
        for name in names:
            a = self.arrays[name]
            flat = self.staging[name][layer % 2].view(self.rows * self.heads, self.capacity, *a.tail)
            for tier, b, e, lo, hi in self._segments_of(f0, f1):
                records = a.to_records(flat[lo:hi, begin:end]).transpose(0, 1).cpu()  # [T, hi - lo, record]
                self._put(layer, a, tier, b, e, lo, hi, begin, records)

    @torch.inference_mode(False)
    def _store_points(self, layer, names, flats, slots):
        order = torch.argsort(slots * (self.rows * self.heads) + flats)  # token-major: neighbours on disk together
        flats, slots = flats[order], slots[order]
        for name in names:
            a = self.arrays[name]
            flat = self.staging[name][layer % 2].view(self.rows * self.heads, self.capacity, *a.tail)
            records = a.to_records(flat[flats.to(self.device), slots.to(self.device)]).cpu()  # [m, record]
            i = 0
            while i < len(flats):  # runs of consecutive (row x head)s at one slot: one write each
                j = i + 1
                while j < len(flats) and slots[j] == slots[i] and flats[j] == flats[j - 1] + 1:
                    j += 1
                lo, hi, slot = int(flats[i]), int(flats[j - 1]) + 1, int(slots[i])
                for tier, b, e, s_lo, s_hi in self._segments_of(lo, hi):
                    self._put(layer, a, tier, b, e, s_lo, s_hi, slot, records[i + s_lo - lo:i + s_hi - lo][None])
                i = j

    def _put(self, layer, a: CacheArray, tier, b, e, lo, hi, begin, records):
        """records [T, hi - lo, record] into tokens begin.. of (row x head)s lo..hi, which lie in segment [b, e)."""
        if tier == "device":
            self.home[a.name, tier][layer][begin:begin + len(records), lo - b:hi - b] = records.to(self.device)
            return
        t = perf_now()
        records = records.cpu()
        self.transfers.add("device_to_host", records.nbytes, perf_now() - t)
        if tier == "host":
            self.home[a.name, tier][layer][begin:begin + len(records), lo - b:hi - b] = records
            return
        f, seg = self.files[a.name], e - b
        base = layer * self.layer_disk_bytes(a)
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
