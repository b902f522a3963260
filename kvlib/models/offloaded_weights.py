"""Decoder layers' weights off the device, FlexGen's way (FMInference/FlexLLMGen@004ffef `flex_opt.py`): each of
FlexGen's layers, a decoder layer's attention and its MLP, has its tensors placed by init_weight_list's rule
(kvlib.memory.placement.tensor_tiers: each tensor to the tier of its midpoint within the layer's elements), so every
layer is split the same way across disk, host and device. Before a layer computes, what it holds off the device is
brought to the device (FlexGen's load_weight into its weight read buffer), the next layer's by a copy thread while this
one computes, then dropped again.

The tensors are FlexGen's: Q, K, V, O (their biases beside them where the model has some) and the attention's norm;
gate, up, down and the MLP's norm. kvlib's forward fuses Q, K and V into one matmul, and gate and up into another: a
fused weight is placed as its parts (rows of it) and put together again when the layer loads, its parts on the
device copied into it (FlexGen's weights on the device are used in place: kvlib's device parts of a fused weight cost
that copy). A host part stays in a host tensor (pinned on CUDA, as FlexGen's `pin_weight`) and is copied each pass
(host->device); a disk part is a run of the layer's file in the offload folder, read each pass (disk->host, then
host->device), out of the page cache (kvlib.memory.disk). While a layer is loaded, a parameter with a part off the
device holds nothing (the model's `weights_bytes` counts what it holds). A prepacked weight (oneDNN,
kvlib.models.loading.PackedLinear) is stored in its plain layout, which packs back exactly, and is packed again when
loaded. `restore` puts every weight back in the model (uncounted: it is the end of the run, not part of it), so a
model shared by several engines is whole again after each session.

It runs inside kvlib's own forward pass (kvlib.models.llama_forward.LlamaForward: `streamer.before(i)` and
`after(i)` around decoder layer i, its attention and MLP loaded together); transformers' forward has no such hook, so
a model without LlamaForward keeps its weights on the device. The wait for a layer's load (what compute did not hide)
is timed as the `weights_wait` section.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch

from kvlib.memory.disk import CopyStream, OffloadFolder, Transfers, host_copy
from kvlib.memory.placement import tensor_tiers
from kvlib.models.loading import PACK_BATCH_HINT, PackedLinear


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.model.layers)


def layer_bytes(layer: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in layer.parameters())


@dataclass(frozen=True)
class Part:
    """Rows [start, stop) of one parameter (dim 0): one of FlexGen's tensors."""
    module: torch.nn.Module
    name: str
    start: int
    stop: int

    @property
    def param(self) -> tuple[torch.nn.Module, str]:
        return self.module, self.name

    def numel(self) -> int:
        """Its elements, from the module's shape (whatever its parameter holds while it streams)."""
        linear = self.name == "weight" and hasattr(self.module, "in_features")
        return (self.stop - self.start) * (self.module.in_features if linear else 1)

    def nbytes(self) -> int:
        return self.numel() * getattr(self.module, self.name).element_size()


def is_packed(module: torch.nn.Module, name: str) -> bool:
    return isinstance(module, PackedLinear) and name == "weight"


def _rows(linear: torch.nn.Module, cuts: list[int]) -> list[Part]:
    """A linear layer's weight and bias cut at these output rows, each part's weight then its bias (FlexGen's order)."""
    out = []
    for a, b in pairwise(cuts):
        out.append(Part(linear, "weight", a, b))
        if linear.bias is not None:
            out.append(Part(linear, "bias", a, b))
    return out


def flexgen_layers(layer: torch.nn.Module) -> list[list[Part]]:
    """A decoder layer as FlexGen's two layers, each its tensors in FlexGen's order (SelfAttention: q, k, v, out,
    norm; MLP: fc1 (gate, up), fc2 (down), norm)."""
    attn, mlp = layer.self_attn, layer.mlp
    q, kv = attn.heads * attn.head_dim, attn.kv_heads * attn.head_dim
    inter = mlp.down_proj.in_features
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    attention = _rows(attn.qkv_proj, [0, q, q + kv, q + 2 * kv]) + _rows(attn.o_proj, [0, attn.o_proj.out_features]) \
        + [Part(norm1, "weight", 0, norm1.weight.shape[0])]
    ffn = _rows(mlp.gate_up, [0, inter, 2 * inter]) + _rows(mlp.down_proj, [0, mlp.down_proj.out_features]) \
        + [Part(norm2, "weight", 0, norm2.weight.shape[0])]
    return [attention, ffn]


def placed_parts(layer: torch.nn.Module, dev_percent: float, host_percent: float) -> list[tuple[Part, str]]:
    """Every tensor of a decoder layer with its tier (init_weight_list's rule within each of FlexGen's layers)."""
    out = []
    for parts in flexgen_layers(layer):
        out += zip(parts, tensor_tiers([p.numel() for p in parts], dev_percent, host_percent))
    return out


def dense(module, name) -> torch.Tensor:
    return module.dense_weight() if is_packed(module, name) else getattr(module, name).detach()


class WeightStreamer:
    def __init__(self, placed: list[list[tuple[Part, str]]], folder: OffloadFolder | None, transfers: Transfers,
                 device: torch.device, timers=None):
        """placed: each decoder layer's parts and their tiers (placed_parts)."""
        self.transfers, self.device, self.timers = transfers, device, timers
        self.copy = CopyStream(device)
        # layer -> its parameters with a part off the device: (module, name) -> [(part, tier, where it is)]
        self.params: dict[int, dict[tuple, list]] = {}
        self.shapes: dict[tuple, tuple[torch.Size, torch.dtype]] = {}
        self.bytes = {"device": 0, "host": 0, "disk": 0}
        self.loaded_bytes: dict[int, int] = {}  # a layer's parameters put together on the device
        self.files = {}
        self.copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlib-weights-copy")
        self.pending: dict[int, Future] = {}
        try:
            for i, parts in enumerate(placed):
                self._place(i, parts, folder)
        except BaseException:
            self.restore()  # (the layers already emptied: a failed start leaves the model whole)
            raise

    def _place(self, i: int, parts: list[tuple[Part, str]], folder: OffloadFolder | None) -> None:
        """Layer i's parameters with a part off the device: their parts to their tiers, then emptied."""
        off = {p.param for p, tier in parts if tier != "device"}
        if not off:
            return
        disk, wholes, params = [], {}, {}
        for part, tier in parts:
            if part.param not in off:
                continue
            if part.param not in wholes:
                wholes[part.param] = dense(*part.param)
            whole = wholes[part.param]
            self.shapes[part.param] = (whole.shape, whole.dtype)
            rows = whole[part.start:part.stop].clone()
            if tier == "disk":
                disk.append(rows)
                rows = sum(r.nbytes for r in disk[:-1])  # its offset in the layer's file
            elif tier == "host":
                rows = host_copy(rows, self.device)
            params.setdefault(part.param, []).append((part, tier, rows))
        if disk:
            f = folder.file(f"weights-{i}.bin", sum(r.nbytes for r in disk))
            f.write(0, np.concatenate([r.cpu().reshape(-1).view(torch.uint8).numpy() for r in disk]), count=False)
            self.files[i] = f
        self.params[i] = params
        for part, tier in parts:
            if part.param in off:
                self.bytes[tier] += part.nbytes()
        self.loaded_bytes[i] = sum(int(np.prod(self.shapes[p][0])) * self.shapes[p][1].itemsize for p in params)
        self._assign(i, None)

    def bytes_on(self, tier: str) -> int:
        """Bytes of the parameters with a part off the device that lie in a tier."""
        return self.bytes[tier]

    def largest_layer_bytes(self) -> int:
        """The most a loaded layer holds on the device (its parameters with a part off it, whole)."""
        return max(self.loaded_bytes.values(), default=0)

    # -- the forward pass's hooks --------------------------------------------------------------------------------
    def before(self, i: int) -> None:
        if i in self.params:
            self._prefetch(i)
            with self.timers.section("weights_wait") if self.timers is not None else nullcontext():
                tensors = self.pending.pop(i).result()
            self._assign(i, tensors)
        nxt = next((j for j in range(i + 1, max(self.params, default=0) + 1) if j in self.params), None)
        if nxt is not None:
            self._prefetch(nxt)

    def after(self, i: int) -> None:
        if i in self.params:
            self._assign(i, None)

    def _prefetch(self, i: int) -> None:
        if i not in self.pending:
            self.pending[i] = self.copy.submit(self.copier, self._load, i, True)

    @torch.inference_mode(False)
    def _load(self, i: int, count: bool) -> dict:
        """Layer i's parameters with a part off the device, put together on the device (a copy job: after the
        compute before it, whose freed memory it may reuse)."""
        raw = self.files[i].read(0, self.files[i].nbytes, count=count) if i in self.files else None
        out = {}
        for param, parts in self.params[i].items():
            shape, dtype = self.shapes[param]
            whole = torch.empty(shape, dtype=dtype, device=self.device)
            for part, tier, rows in parts:
                into = whole[part.start:part.stop]
                if tier == "device":
                    into.copy_(rows)  # (FlexGen computes on such a tensor in place; a fused weight costs this copy)
                    continue
                if tier == "disk":
                    rows = torch.from_numpy(raw[rows:rows + into.nbytes]).view(dtype).reshape(into.shape)
                self.copy.into(into, rows, self.transfers if count else None)
            out[param] = torch.ops.mkldnn._reorder_linear_weight(whole, PACK_BATCH_HINT) if is_packed(*param) else whole
        return out

    def _assign(self, i: int, tensors: dict | None) -> None:
        """Layer i's parameters with a part off the device set to these tensors, or emptied (None)."""
        for (module, name) in self.params[i]:
            dtype = self.shapes[module, name][1]
            value = tensors[module, name] if tensors is not None else torch.empty(0, dtype=dtype, device=self.device)
            if is_packed(module, name):
                # an opaque oneDNN tensor cannot take another's data: a new parameter
                setattr(module, name, torch.nn.Parameter(value, requires_grad=False))
            else:
                getattr(module, name).data = value  # in place: kvlib's forward holds the norms' weights themselves

    def restore(self) -> None:
        """Every offloaded layer's weights back in the model, for good."""
        for future in self.pending.values():
            future.cancel()
        self.copier.shutdown(wait=True)
        self.pending = {}
        for i in self.params:
            self._assign(i, self._load(i, count=False))
        self.params = {}
