"""Decoder layers' weights off the device, FlexGen's way: a layer's weights go whole to the tier of their size midpoint
(kvlib.memory.placement.weight_tiers) and are brought to the device for the layer's compute only, the next layer's
loaded by a copy thread while this one computes, then dropped again.

A host layer's weights stay in host tensors and are copied each pass (host->device); a disk layer's are one file of the
offload folder, read each pass (disk->host, then host->device), out of the page cache (kvlib.memory.disk). While a
layer is off the device its parameters hold nothing (so the model's `weights_bytes` counts only what is on the device).
A prepacked weight (oneDNN, kvlib.models.loading.PackedLinear) is stored in its plain layout, which packs back
exactly, and is packed again when loaded. `restore` puts every weight back in the model (uncounted: it is the end of
the run, not part of it), so a model shared by several engines is whole again after each session.

It runs inside kvlib's own forward pass (kvlib.models.llama_forward.LlamaForward: `streamer.before(i)` and
`after(i)` around layer i); transformers' forward has no such hook, so a model without LlamaForward keeps its weights
on the device.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from time import perf_counter

import numpy as np
import torch

from kvlib.memory.disk import OffloadFolder, Transfers
from kvlib.models.loading import PACK_BATCH_HINT, PackedLinear


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.model.layers)


def layer_bytes(layer: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in layer.parameters())


def layer_parameters(layer: torch.nn.Module) -> list[tuple[torch.nn.Module, str, bool]]:
    """(module, parameter name, packed) of every parameter of a decoder layer, in a fixed order."""
    out = []
    for module in layer.modules():
        for name, p in module.named_parameters(recurse=False):
            if p is not None:
                out.append((module, name, isinstance(module, PackedLinear) and name == "weight"))
    return out


def dense(module, name, packed) -> torch.Tensor:
    return module.dense_weight() if packed else getattr(module, name).detach()


class WeightStreamer:
    def __init__(self, layers: list[torch.nn.Module], tiers: list[str], folder: OffloadFolder | None,
                 transfers: Transfers):
        self.layers, self.tiers, self.transfers = layers, tiers, transfers
        self.params = {i: layer_parameters(layers[i]) for i, t in enumerate(tiers) if t != "device"}
        self.shapes = {i: [(dense(*e).shape, dense(*e).dtype) for e in entries] for i, entries in self.params.items()}
        self.bytes = {i: sum(int(np.prod(s)) * torch.empty((), dtype=d).element_size() for s, d in shapes)
                      for i, shapes in self.shapes.items()}
        self.host: dict[int, list[torch.Tensor]] = {}
        self.files = {}
        for i, entries in self.params.items():
            tensors = [dense(*e).clone() for e in entries]
            if tiers[i] == "host":
                self.host[i] = tensors
            else:
                f = folder.file(f"weights-{i}.bin", self.bytes[i])
                f.write(0, np.concatenate([t.contiguous().reshape(-1).view(torch.uint8).numpy() for t in tensors]),
                        count=False)
                self.files[i] = f
            self._assign(i, None)
        self.copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlib-weights-copy")
        self.pending: dict[int, Future] = {}

    def bytes_on(self, tier: str) -> int:
        return sum(n for i, n in self.bytes.items() if self.tiers[i] == tier)

    def largest_layer_bytes(self) -> int:
        return max(self.bytes.values(), default=0)

    # -- the forward pass's hooks --------------------------------------------------------------------------------
    def before(self, i: int) -> None:
        if i in self.params:
            self._prefetch(i)
            self._assign(i, self.pending.pop(i).result())
        nxt = next((j for j in range(i + 1, len(self.layers)) if j in self.params), None)
        if nxt is not None:
            self._prefetch(nxt)

    def after(self, i: int) -> None:
        if i in self.params:
            self._assign(i, None)

    def _prefetch(self, i: int) -> None:
        if i not in self.pending:
            self.pending[i] = self.copier.submit(self._load, i, True)

    @torch.inference_mode(False)
    def _load(self, i: int, count: bool) -> list[torch.Tensor]:
        if self.tiers[i] == "host":
            t = perf_counter()
            out = [h.clone() for h in self.host[i]]
            if count:
                self.transfers.add("host_to_device", self.bytes[i], perf_counter() - t)
        else:
            raw = self.files[i].read(0, self.bytes[i], count=count)
            t = perf_counter()
            out, at = [], 0
            for shape, dtype in self.shapes[i]:
                n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
                out.append(torch.from_numpy(raw[at:at + n].copy()).view(dtype).reshape(shape))
                at += n
            if count:
                self.transfers.add("host_to_device", self.bytes[i], perf_counter() - t)
        return [torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT) if packed else w
                for w, (_, _, packed) in zip(out, self.params[i])]

    def _assign(self, i: int, tensors: list[torch.Tensor] | None) -> None:
        """Layer i's parameters set to these tensors, or emptied (None)."""
        for k, (module, name, packed) in enumerate(self.params[i]):
            p = getattr(module, name)
            value = tensors[k] if tensors is not None else torch.empty(0, dtype=self.shapes[i][k][1])
            if packed:  # an opaque oneDNN tensor cannot take another's data: a new parameter
                setattr(module, name, torch.nn.Parameter(value, requires_grad=False))
            else:
                p.data = value  # in place: kvlib's forward holds the norms' weights themselves

    def restore(self) -> None:
        """Every offloaded layer's weights back in the model, for good."""
        for future in self.pending.values():
            future.cancel()
        self.copier.shutdown(wait=True)
        self.pending = {}
        for i in self.params:
            self._assign(i, self._load(i, count=False))
        self.params = {}
