"""InfiniGen's offline step: per layer and KV head, an orthogonal "skewing" matrix that concentrates the query-key
product in few columns, and the columns speculation keeps.

From a calibration prompt we capture each layer's queries and keys after RoPE (Llama-family models rotate after the
projection, so the skew cannot be folded into the weights as InfiniGen does for OPT). Any orthogonal A leaves the
product unchanged, (QA)(KA)^T = QK^T; the basis decides which few columns carry most of it.

`basis="query"` is the official code's (snu-comparch/InfiniGen, accuracy/setup/gen_llama_skewing_matrix.py and
modeling_llama_ours_setup.py): A holds the right singular vectors of the head's queries Q, and speculation keeps the
union of the int(ratio x D) columns with the largest summed |QA| and the int(ratio x D) with the largest summed |KA|,
so a head keeps between int(ratio x D) and twice that. The official code is multi-head; under grouped-query attention
a KV head's A comes from its group's queries stacked. `basis="joint"` is kvlib's earlier rule: the right singular
vectors of the stacked [Q; K], whose first ceil(ratio x D) columns (ordered by singular value) are kept.
Without skewing (A = I, for comparison) the kept columns are the ones with the largest mean |q|*|k| on calibration.
A head that keeps fewer columns than the widest is padded with zero columns, which add nothing to a score.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from kvlib.models import LoadedModel
from kvlib.paths import cache_dir
from kvlib.policies.base import KVPolicy, Step

BASES = ("query", "joint")


@dataclass
class Skew:
    matrices: torch.Tensor  # [layers, Hkv, D, D]; columns = new basis
    columns: torch.Tensor  # [layers, Hkv, r]: the partial columns kept, in the skewed basis (-1: a padding column)

    def cut(self) -> torch.Tensor:
        """Skewing then keeping the partial columns as one product with the kept columns of A: [L, Hkv, D, r]
        (a padding column zero)."""
        index = self.columns.clamp(min=0)[:, :, None, :].expand(-1, -1, self.matrices.shape[-2], -1)
        cut = self.matrices.gather(-1, index)
        return cut.masked_fill((self.columns < 0)[:, :, None, :], 0).contiguous()


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
    step = Step(capture, torch.tensor([0]), torch.tensor([0]), len(prompt), "prefill", logits=False)
    model.forward(torch.tensor([prompt]), torch.arange(len(prompt))[None], step)
    return capture.queries, capture.keys


def compute_skew(model: LoadedModel, prompt: list[int], partial_ratio: float, skew: bool = True,
                 basis: str = "query") -> Skew:
    spec = model.spec
    group = spec.num_attention_heads // spec.num_kv_heads
    queries, keys = capture_qk(model, prompt)
    mats, cols = [], []
    for layer in range(spec.num_layers):
        q, k = queries[layer].float(), keys[layer].float()  # [Hq, T, D], [Hkv, T, D]
        for h in range(spec.num_kv_heads):
            a, chosen = _head_basis(q[h * group:(h + 1) * group].reshape(-1, spec.head_dim), k[h], partial_ratio,
                                    skew, basis)
            mats.append(a)
            cols.append(chosen)
    width = max(len(c) for c in cols)
    cols = [torch.cat([c, c.new_full((width - len(c),), -1)]) for c in cols]
    shape = (spec.num_layers, spec.num_kv_heads)
    return Skew(torch.stack(mats).reshape(*shape, spec.head_dim, spec.head_dim).to(spec.dtype),
                torch.stack(cols).reshape(*shape, width))


def _head_basis(q: torch.Tensor, k: torch.Tensor, ratio: float, skew: bool, basis: str):
    """One KV head's A [D, D] and its kept columns, ascending: q [T x group, D], k [T, D]."""
    d = q.shape[-1]
    if not skew:
        r = max(1, math.ceil(ratio * d))
        return torch.eye(d), (q.abs().mean(0) * k.abs().mean(0)).topk(r).indices.sort().values
    if basis == "joint":
        return torch.linalg.svd(torch.cat([q, k]), full_matrices=True)[2].T, torch.arange(max(1, math.ceil(ratio * d)))
    a = torch.linalg.svd(q, full_matrices=True)[2].T
    r = max(1, int(ratio * d))
    union = torch.cat([(q @ a).abs().sum(0).topk(r).indices, (k @ a).abs().sum(0).topk(r).indices])
    return a, torch.unique(union)


def load_or_compute_skew(model: LoadedModel, prompt: list[int], partial_ratio: float, skew: bool = True,
                        basis: str = "query") -> Skew:
    """Computed once per model and calibration setting, then read from the kvlib cache."""
    first = next(model.model.parameters()).detach().flatten()
    # summed in slices: a float64 copy of the whole embedding at once is 4 GB for Llama-3.1-8B, 8 GB for 70B
    weights_sum = sum(float(part.double().sum()) for part in first.split(1 << 22))
    # the joint basis keeps its earlier key, so skews computed before the official basis are still read
    key = (model.name, tuple(prompt), partial_ratio, skew, weights_sum) + ((basis,) if skew and basis != "joint" else ())
    fingerprint = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    path = cache_dir() / "artifacts" / model.name.replace("/", "--") / f"infinigen-skew-{fingerprint}.pt"
    if path.exists():
        saved = torch.load(path)
        return Skew(saved["matrices"], saved["columns"])
    result = compute_skew(model, prompt, partial_ratio, skew, basis)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"matrices": result.matrices, "columns": result.columns}, tmp)
    tmp.replace(path)
    return result
