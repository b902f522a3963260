"""InfiniGen's offline step: per layer and KV head, an orthogonal "skewing" matrix that concentrates the query-key
product in few columns, and the columns speculation keeps.

From a calibration prompt we capture each layer's queries and keys after RoPE (Llama-family models rotate after the
projection, so the skew cannot be folded into the weights as InfiniGen does for OPT). For a KV head and its group of
query heads, the right singular vectors of the stacked [Q; K] matrix give A (orthogonal): (QA)(KA)^T = QK^T exactly,
and the columns of QA and KA come out ordered by singular value, so the first few carry most of the product.
Without skewing (A = I, for comparison) the kept columns are the ones with the largest mean |q|*|k| on calibration.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from kvlib.models import LoadedModel
from kvlib.paths import cache_dir
from kvlib.policies.base import KVPolicy, Step


@dataclass
class Skew:
    matrices: torch.Tensor  # [layers, Hkv, D, D]; columns = new basis
    columns: torch.Tensor  # [layers, Hkv, r]: the partial columns kept, in the skewed basis


class QKRecorder(KVPolicy):
    """A one-pass policy that caches nothing: causal attention over the pass's own keys, recording each layer's
    post-RoPE queries and keys (not registered: no one runs it as a KV-cache policy)."""

    def __init__(self):
        self.queries, self.keys = {}, {}

    def attend(self, layer, query, key, value, step):
        self.queries[layer], self.keys[layer] = query[0], key[0]
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)


@torch.inference_mode()
def capture_qk(model: LoadedModel, prompt: list[int]) -> tuple[dict, dict]:
    capture = QKRecorder()
    step = Step(capture, torch.tensor([0]), torch.tensor([0]), len(prompt), "prefill")
    model.forward(torch.tensor([prompt]), torch.arange(len(prompt))[None], step)
    return capture.queries, capture.keys


def compute_skew(model: LoadedModel, prompt: list[int], partial_ratio: float, skew: bool = True) -> Skew:
    spec = model.spec
    group = spec.num_attention_heads // spec.num_kv_heads
    r = max(1, math.ceil(partial_ratio * spec.head_dim))
    queries, keys = capture_qk(model, prompt)
    mats, cols = [], []
    for layer in range(spec.num_layers):
        q, k = queries[layer].float(), keys[layer].float()  # [Hq, T, D], [Hkv, T, D]
        layer_mats, layer_cols = [], []
        for h in range(spec.num_kv_heads):
            qh = q[h * group:(h + 1) * group].reshape(-1, spec.head_dim)
            if skew:
                _, _, vh = torch.linalg.svd(torch.cat([qh, k[h]]), full_matrices=True)
                a = vh.T
                chosen = torch.arange(r)
            else:
                a = torch.eye(spec.head_dim)
                chosen = (qh.abs().mean(0) * k[h].abs().mean(0)).topk(r).indices.sort().values
            layer_mats.append(a)
            layer_cols.append(chosen)
        mats.append(torch.stack(layer_mats))
        cols.append(torch.stack(layer_cols))
    return Skew(torch.stack(mats).to(spec.dtype), torch.stack(cols))


def load_or_compute_skew(model: LoadedModel, prompt: list[int], partial_ratio: float, skew: bool = True) -> Skew:
    """Computed once per model and calibration setting, then read from the kvlib cache."""
    first = next(model.model.parameters()).detach().flatten()
    # summed in slices: a float64 copy of the whole embedding at once is 4 GB for Llama-3.1-8B, 8 GB for 70B
    weights_sum = sum(float(part.double().sum()) for part in first.split(1 << 22))
    fingerprint = hashlib.sha256(repr((model.name, tuple(prompt), partial_ratio, skew,
                                       weights_sum)).encode()).hexdigest()[:16]
    path = cache_dir() / "artifacts" / model.name.replace("/", "--") / f"infinigen-skew-{fingerprint}.pt"
    if path.exists():
        saved = torch.load(path)
        return Skew(saved["matrices"], saved["columns"])
    result = compute_skew(model, prompt, partial_ratio, skew)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"matrices": result.matrices, "columns": result.columns}, tmp)
    tmp.replace(path)
    return result
