"""FlexGen (Sheng et al., 2023): the full cache, placed across device, host and disk and streamed layer by layer.

Every key and value is kept, as `full` keeps them (one contiguous reservation per row, the longest prompt plus
max_new_tokens), but each layer's cache is cut along rows x heads, in whole rows as FlexGen cuts it, into a device, a
host and a disk segment by FlexGen's percentages (`percent`: W_DEV W_HOST KV_DEV KV_HOST ACT_DEV ACT_HOST, the disk
taking the rest; kvlib.memory.placement), optionally 4-bit compressed on every tier (`compress_cache`, FlexGen's group
format: kvlib.memory.quant4). Below 100 % W_DEV each decoder layer's tensors are placed as FlexGen places them, every
layer split the same way, and streamed to the device around the layer (kvlib.models.offloaded_weights). A layer
computes on a device staging buffer into which its cache was loaded while the unit before computed
(kvlib.memory.tiered_kv); what it wrote (a prompt's tokens, a decode step's one token) goes back to the tiers after
it. The disk segment lives in files of a private folder inside `offload_dir` (kvlib.memory.disk: counted, out of the
page cache, removed at the end; a killed run's folder swept by the next run).

`gpu_batch_size` (FlexGen's word) cuts the batch into micro-batches of that many rows: a decode pass runs each layer on
each micro-batch in turn (kvlib.models.llama_forward), the layer's weights loaded once for the block and the next
micro-batch's cache loading while one computes, so the device stages two micro-batches' cache of a layer, not the
batch's.

Placement moves bytes, never changes them: uncompressed, every placement decodes exactly the tokens of the cache wholly
on the device, which is `full`'s cache (tests/policies/test_flexgen.py). This is a policy of its own, not a setting
of `full`, because FlexGen's cache is a different mechanism (staged per layer, stored back per pass) beside the same
attention; the attention itself is `full`'s: the same prefill attention and the one decode kernel over each row in
place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlib.errors import UserError
from kvlib.kernels.attention import prefill_attention
from kvlib.kernels.decode import DecodeReads
from kvlib.memory import quant4
from kvlib.memory.disk import OffloadFolder, Transfers
from kvlib.memory.placement import Placement
from kvlib.memory.tiered_kv import CacheArray, TieredKV, groups_of
from kvlib.models.offloaded_weights import WeightStreamer, decoder_layers, placed_parts
from kvlib.paths import cache_dir
from kvlib.policies.base import KVPolicy, Step
from kvlib.policies.fidelity import Fidelity, Rule, Source
from kvlib.policies.registry import register

ALL_ON_DEVICE = "100 0 100 0 100 0"
FLEXGEN = Source("FMInference/FlexLLMGen", "004ffef82b46e8dc8685c55d0cdda650bdaf1269",
                 "flexllmgen/flex_opt.py, flexllmgen/pytorch_backend.py, flexllmgen/compression.py")


def default_offload_dir() -> str:
    return str(cache_dir() / "offload")


@register
@dataclass
class FlexGenPolicy(KVPolicy):
    name = "flexgen"
    small_example: ClassVar[dict] = {"percent": "100 0 40 60 100 0"}  # the cache on device and host
    keeps_all_example: ClassVar[dict] = {"percent": "100 0 40 60 100 0"}
    lossless = True  # uncompressed; compress_cache makes it lossy (the setting is recorded with every run)
    # full's three: a later chunk reads what the row's earlier chunks stored (the pass loads each row's first tokens)
    host_tensors = ("host_arrays",)

    percent: str = ALL_ON_DEVICE
    offload_dir: str | None = None  # None: kvlib's cache folder, offload/
    compress_cache: bool = False
    gpu_batch_size: int | None = None  # rows a micro-batch (None: the batch is one)

    fidelity = Fidelity(FLEXGEN, rules=(
        Rule("percent", "100 0 100 0 100 0", setting="percent"),
        Rule("weight placement", "each tensor of a layer to the tier of its midpoint, disk-host-device",
             kvlib="each tensor of a layer to the tier of its midpoint, disk-host-device"),
        Rule("a layer placed", "attention, MLP (each by itself)", kvlib="attention, MLP (each by itself)"),
        Rule("weights streamed as", "attention, then MLP (sep_layer)", kvlib="a decoder layer: attention and MLP",
             differs="kvlib's forward hooks a decoder layer; each split the same, a load twice FlexGen's"),
        Rule("embedding and head", "placed by the same rule", kvlib="on the device",
             differs="kvlib's forward streams decoder layers only"),
        Rule("a layer's device tensors", "used in place",
             kvlib="used in place; a fused Q/K/V or gate/up with a part off the device put together, its device "
                   "part copied", differs="kvlib fuses Q, K, V (and gate, up) into one matmul"),
        Rule("KV split", "batch x heads, device and host rounded down to whole rows, the last tier the rest",
             kvlib="batch x heads, device and host rounded down to whole rows, the last tier the rest"),
        Rule("GPU batches a block (default)", 1, kvlib=1),
        Rule("host weights", "pinned (pin_weight)", kvlib="pinned (pin_weight)"),
        Rule("host KV", "pageable, copied through a pinned relay", kvlib="pageable, copied through a pinned relay"),
        Rule("copy streams", "3: weight loads, cache loads, cache stores", kvlib="2: weights; cache loads and stores",
             differs="one copy thread orders a cache's loads and stores, so a load sees the stores before it"),
        Rule("disk flush", "none (the page cache may serve reads)", kvlib="fdatasync and page drop each pass",
             differs="a disk read is then the disk's; timed apart (disk_flush_s)"),
        Rule("compress_cache", False, setting="compress_cache"),
        Rule("4-bit format", "min-max, fp16 min and 15 / range a group",
             kvlib="min-max, fp16 min and range / 15 a group",
             differs="the same bytes; the step rounded, not its inverse; a constant group decodes, not NaN"),
        Rule("4-bit group", "64 along head_dim, zero-padded", kvlib="64, or a narrower head whole; others refused",
             differs="the same at head_dim 64 and 128; no padding codes at 16"),
        Rule("4-bit cache on several tiers", "refused", kvlib="allowed", differs="kvlib's extension"),
    ), note="FlexGen's OPT engine; kvlib runs its placement and schedule on Llama-family models")

    def __post_init__(self):
        if not isinstance(self.percent, str):  # six numbers from a params file
            self.percent = " ".join(f"{float(v):g}" for v in self.percent)
        self.placement = Placement.parse(self.percent)
        self.weights = self.store = self.folder = self.transfers = None  # (finish may run before start made them)
        if not isinstance(self.compress_cache, bool):
            raise UserError(f"compress_cache must be true or false, got {self.compress_cache!r}")
        if self.gpu_batch_size is not None and (not isinstance(self.gpu_batch_size, int) or self.gpu_batch_size < 1):
            raise UserError(f"gpu_batch_size must be a whole number >= 1, got {self.gpu_batch_size!r}")

    def granularity(self) -> str:
        unit = "a row reserved whole, split by rows x heads across tiers"
        return unit if self.gpu_batch_size is None else f"{unit}, in micro-batches of {self.gpu_batch_size} rows"

    def kv_bits(self) -> float:
        """Bits a stored key or value element costs: a 4-bit record's codes with its groups' fp16 scale and minimum
        (4.5 at a 64-wide group, 6 at a 16-wide head)."""
        if not self.compress_cache:
            return super().kv_bits()
        return 8 * quant4.record_bytes(self.spec.head_dim) / self.spec.head_dim

    # -- what a subclass adds to the cache -------------------------------------------------------------------------
    def cache_arrays(self) -> list[CacheArray]:
        s = self.spec
        return [CacheArray(n, (s.head_dim,), s.dtype, 0.0, self.compress_cache) for n in ("keys", "values")]

    def cache_capacity(self, prompt_lens: list[int], max_new_tokens: int) -> int:
        return max(prompt_lens) + max_new_tokens

    # -- weights ---------------------------------------------------------------------------------------------------
    def needs_own_forward(self, what: str, keep: str) -> None:
        """transformers' forward has no hook around a layer: what streams per layer runs in kvlib's own only."""
        if self.model.kvlib_forward is None:
            raise UserError(f"policy {self.name!r} {what} only in kvlib's own forward pass (a Llama-family model in "
                            f"fp32 on a CPU); {keep} for {self.model.name!r}")

    def weight_parts(self) -> list:
        """Each decoder layer's tensors with their tiers (offloaded_weights.placed_parts: FlexGen's init_weight_list
        within its attention and its MLP; the embedding, final norm and head stay on the device); [] where every
        weight stays on the device."""
        if self.placement.weights[0] == 1:
            return []
        self.needs_own_forward("places weights off the device", "keep W_DEV at 100")
        return [placed_parts(layer, *self.placement.percents[0:2]) for layer in decoder_layers(self.model.model)]

    def weights_off_device(self) -> int:
        return sum(part.nbytes() for parts in self.weight_parts() for part, tier in parts if tier != "device")

    # -- lifecycle ---------------------------------------------------------------------------------------------------
    def start(self, batch_size, prompt_lens, max_new_tokens):
        s = self.spec
        self.weights = self.store = self.folder = None  # what finish undoes, none of it made yet
        self.transfers = Transfers(self.work)
        self.capacity = capacity = self.cache_capacity(prompt_lens, max_new_tokens)
        arrays = self.cache_arrays()
        per_row = capacity * s.num_kv_heads * s.num_layers * sum(a.record_bytes for a in arrays)
        rows = self.row_capacity(batch_size, max(1, round(per_row * self.placement.kv[0])))
        group_rows = min(self.gpu_batch_size or rows, rows)
        if group_rows < rows:
            self.needs_own_forward("runs micro-batches", "leave gpu_batch_size unset")
        groups = groups_of(rows, s.num_kv_heads, group_rows, self.placement.percents[2:4])
        dev, disk = (sum(g.size(t) for g in groups) for t in ("device", "disk"))
        parts = self.weight_parts()
        tiers = {tier for layer in parts for _, tier in layer}
        if disk or "disk" in tiers:
            self.folder = OffloadFolder(self.offload_dir or default_offload_dir(), self.transfers)
        try:
            if tiers - {"device"}:
                self.weights = WeightStreamer(parts, self.folder, self.transfers, self.device, self.timers)
                self.model.kvlib_forward.streamer = self.weights
                # a layer computing and the next one loading: FlexGen's two weight buffers on the device
                self.ledger.add("device", "weights", 2 * self.weights.largest_layer_bytes(), where="weights staging")
                for tier in ("host", "disk"):
                    self.ledger.add(tier, "weights", self.weights.bytes_on(tier))
            self.ledger.add("device", "kv_reserved", per_row * dev // s.num_kv_heads, where=f"{self.name} KV, device")
            self.store = TieredKV(arrays, s.num_layers, groups, s.num_kv_heads, capacity, self.device, self.transfers,
                                  self.folder)
            self.device_arrays, self.host_arrays = self.store.tensors("device"), self.store.tensors("host")
            self.init_rows(rows)
            self._book()
        except BaseException:
            self.finish()
            raise

    def init_rows(self, rows: int) -> None:
        """The per-row counters, before anything is booked."""
        self.lengths = torch.zeros(rows, dtype=torch.long)

    def prepare(self, step: Step):
        # a pass reads what its rows held before it (a prompt's first pass: nothing); decode writes one token a row
        self.begin_pass(step, step.start)

    def begin_pass(self, step: Step, reads: torch.Tensor) -> None:
        """Start a pass whose rows read reads [B] tokens each: cut into micro-batches where its rows span several
        groups, each group loading its rows' longest; what it moves is counted as its phase's."""
        self.transfers.phase = step.phase
        store = self.store
        groups = step.rows // store.group_rows
        step.parts = step.split(groups) if bool((groups != groups[0]).any()) else None
        store.begin_pass([(store.place(int(p.rows[0]))[0], int(p.own(reads).max())) for p in step.parts or [step]])

    def flats(self, rows: torch.Tensor) -> torch.Tensor:
        """The (row x head) indices of these rows, row-major."""
        h = self.spec.num_kv_heads
        return (rows[:, None] * h + torch.arange(h)[None, :]).reshape(-1)

    def layer_arrays(self, layer: int, step: Step) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
        """The cache of the layer's unit of this (part of a) pass on the device, the step's rows' places in it, and its
        group."""
        group = self.store.place(int(step.rows[0]))[0]
        return self.unit(layer, group), step.rows % self.store.group_rows, group

    def unit(self, layer: int, group: int) -> dict[str, torch.Tensor]:
        """A unit's arrays on the device; the wait for its load (what compute did not hide) timed as a fetch."""
        if self.store.resident:
            return self.store.layer(layer, group)
        with self.timers.section("fetch"):
            return self.store.layer(layer, group)

    def settle(self) -> None:
        """After a pass: its stores done, the disk flushed (timed as offloading)."""
        if not self.store.resident:
            with self.timers.section("offload"):
                self.store.settle(self.folder)

    def attend(self, layer, query, key, value, step: Step):
        arrays, at, group = self.layer_arrays(layer, step)
        kc, vc = arrays["keys"], arrays["values"]
        t, h = step.q_len, self.spec.num_kv_heads
        if step.phase == "decode":
            pos = step.start.to(self.device)
            kc[at.to(self.device), :, pos] = key[:, :, 0]
            vc[at.to(self.device), :, pos] = value[:, :, 0]
            self.store.store_points(layer, group, ("keys", "values"), self.flats(at), step.start.repeat_interleave(h))
            self.usage.add(layer, step.tokens_seen, step.tokens_seen, len(step.rows))
            return self.decode_attention(layer, query, DecodeReads(kc, vc, step.start + 1, rows=at))[0]
        row, begin = int(at[0]), int(step.start[0])
        end = begin + t
        kc[row, :, begin:end] = key[0]
        vc[row, :, begin:end] = value[0]
        self.store.store_range(layer, group, ("keys", "values"), begin, end, (row, row + 1))
        return prefill_attention(query, kc[row:row + 1, :, :end], vc[row:row + 1, :, :end], begin,
                                 step.prefill_mode, self.scale, self.ledger, layer)

    def after_pass(self, step: Step):
        self.settle()
        self.lengths[step.rows] = step.start + step.q_len
        self._book()

    def fork(self, src, dst):
        self.copy_row(src, dst, int(self.lengths[src]))
        self.lengths[dst] = self.lengths[src]
        self._book()

    def copy_row(self, src: int, dst: int, n: int) -> None:
        """Every array's first n slots of row src into row dst, on every layer (each row in a unit of its group)."""
        store = self.store
        (gs, s), (gd, d) = store.place(src), store.place(dst)
        store.begin_pass([(gs, n)] + ([(gd, 0)] if gd != gs else []))
        for layer in range(self.spec.num_layers):
            arrays = self.unit(layer, gs)
            copied = {name: t[s, :, :n].clone() for name, t in arrays.items()}  # (its buffer takes the next unit)
            if gd != gs:
                arrays = self.unit(layer, gd)
            for name, t in arrays.items():
                t[d, :, :n] = copied[name]
            store.store_range(layer, gd, list(arrays), 0, n, (d, d + 1))
        self.settle()

    def release(self, row):
        """The row is free for another request (its whole length stays reserved, as `full`'s)."""
        self.lengths[row] = 0
        self._book()

    def tokens_per_flat(self) -> torch.Tensor:
        """Tokens each (row x head) holds, for booking."""
        return self.lengths.repeat_interleave(self.spec.num_kv_heads)

    def _book(self):
        used = self.tokens_per_flat()
        for tier in ("device", "host", "disk"):
            kv = self.store.tier_bytes(tier, used)
            extra = {"overhead": self.store.staging_bytes()} if tier == "device" else {}
            self.ledger.set(tier, f"{self.name} KV, {tier}", kv=kv, kv_reserved=self.store.tier_bytes(tier) - kv,
                            **extra)

    def finish(self):
        """Undo what start made, however far it got (an error in start is never replaced by one here)."""
        try:
            if self.store is not None:
                self.store.close()
            if self.weights is not None:
                self.model.kvlib_forward.streamer = None
                self.weights.restore()
                self.ledger.add("device", "weights", -2 * self.weights.largest_layer_bytes())
                for tier in ("host", "disk"):
                    self.ledger.add(tier, "weights", -self.weights.bytes_on(tier))
        finally:
            self.weights = None
            self.store = None
            self.device_arrays = self.host_arrays = []
            if self.folder is not None:
                self.folder.close()
            for tier in ("device", "host", "disk"):
                self.ledger.set(tier, kv=0, kv_reserved=0, **({"overhead": 0} if tier == "device" else {}))

    def stats(self) -> dict:
        out = {"percent": self.percent, "compress_cache": self.compress_cache}
        if getattr(self, "transfers", None) is not None:
            out.update(self.transfers.summary())
        return out
