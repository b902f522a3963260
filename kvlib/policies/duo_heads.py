"""DuoAttention's offline step, training-free: which (layer, KV head) needs every entry (a retrieval head) and which
does with attention sinks and a recent window (a streaming head).

One calibration pass over an offline text records each layer's queries and keys after RoPE. A head's score is the
attention mass a streaming head would lose: for every query of the text that has a middle to lose (position q >
sink + window), the probability it puts on positions sink .. q - window - 1 (neither a sink nor in its recent window,
the query itself included in the window), averaged over the queries and over the KV head's group of query heads. The
heads with the highest scores are the retrieval heads; `ratio` of all (layer, KV head) pairs, chosen across layers,
as DuoAttention thresholds its gates model-wide (at the same count: retrieval_count).

Read: mit-han-lab/duo-attention (a gate per head, learned by distilling the full model's outputs on passkey text, so
that streaming heads are those whose output changes least under the streaming pattern) and NVIDIA/kvpress's
DuoAttentionPress (its on-the-fly score: one mean query and mean key per head, the last query's cumulative attention
over the positions, its area; heads ranked model-wide). Deviations: the score here is the lost mass itself, measured
with the text's own queries and keys and with the sink and window the policy will use, rather than a learned gate (a
training loop does not fit the study's CPU budget) or a positional proxy; it is cheap (one forward pass and one
attention matrix a layer) and is computed once per model, text and (sink, window), then read from the kvlib cache.
"""

from __future__ import annotations

import hashlib
import math

import torch

from kvlib.errors import UserError
from kvlib.models import LoadedModel
from kvlib.models.workloads import CALIBRATION_TOKENS, corpus_ids, prompt_of_length
from kvlib.paths import cache_dir
from kvlib.policies.infinigen_skew import capture_qk


def compute_head_scores(model: LoadedModel, prompt: list[int], sink: int, window: int) -> torch.Tensor:
    """[layers, Hkv] float32: the mean attention mass outside the sinks and the recent window (see the module)."""
    spec = model.spec
    first = sink + window + 1  # the first query position with a middle to lose
    if len(prompt) <= first:
        raise UserError(f"the calibration text ({len(prompt)} tokens) is too short for sink={sink} and "
                        f"window={window}: it needs more than {first} tokens")
    group = spec.num_attention_heads // spec.num_kv_heads
    queries, keys = capture_qk(model, prompt)
    positions = torch.arange(len(prompt))
    query_pos = positions[first:, None]  # [n, 1]
    middle = (positions[None, :] >= sink) & (positions[None, :] < query_pos - window)  # [n, T]
    causal = positions[None, :] <= query_pos
    scores = torch.zeros(spec.num_layers, spec.num_kv_heads)
    for layer in range(spec.num_layers):
        q = queries[layer][:, first:].float().cpu()  # [Hq, n, D]
        k = keys[layer].float().cpu()  # [Hkv, T, D]
        q = q.view(spec.num_kv_heads, group, *q.shape[1:])
        logits = torch.einsum("hgnd,htd->hgnt", q, k) * spec.head_dim ** -0.5
        probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
        scores[layer] = (probs * middle).sum(dim=-1).mean(dim=(1, 2))
    return scores


def head_scores(model: LoadedModel, prompt: list[int], sink: int, window: int) -> torch.Tensor:
    """compute_head_scores, computed once per model, text and (sink, window), then read from the kvlib cache."""
    first = next(model.model.parameters()).detach().flatten()
    weights_sum = sum(float(part.double().sum()) for part in first.split(1 << 22))  # tells random weights apart
    fingerprint = hashlib.sha256(repr((model.name, tuple(prompt), sink, window, weights_sum)).encode()).hexdigest()[:16]
    path = cache_dir() / "artifacts" / model.name.replace("/", "--") / f"duo-head-scores-{fingerprint}.pt"
    if path.exists():
        return torch.load(path)
    scores = compute_head_scores(model, prompt, sink, window)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(scores, tmp)
    tmp.replace(path)
    return scores


def retrieval_count(ratio: float, layers: int, kv_heads: int) -> int:
    """How many heads keep every entry at `ratio` (1 - the official sparsity). The official sparsify_attention_heads
    (duo_attn/utils.py) thresholds the gates at their `sparsity` quantile (numpy's linear one, at index sparsity x
    (n - 1)) and keeps the heads at or above it: n - ceil(sparsity x (n - 1)) of n distinct gates; sparsity 1 keeps
    none."""
    if not 0 <= ratio <= 1:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    n = layers * kv_heads
    if ratio == 0:
        return 0
    # rounded first: 1 - ratio carries float noise that the sparsity the official code is given does not
    return n - math.ceil(round((1 - ratio) * (n - 1), 9))


def choose_retrieval(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """[layers, Hkv] bool: the `ratio` of heads with the highest scores, model-wide (ties: the earlier head)."""
    count = retrieval_count(ratio, *scores.shape)
    order = torch.sort(scores.flatten(), descending=True, stable=True).indices[:count]
    chosen = torch.zeros(scores.numel(), dtype=torch.bool)
    chosen[order] = True
    return chosen.view(scores.shape)


def retrieval_heads(model: LoadedModel, prompt: list[int], ratio: float, sink: int = 4, window: int = 256
                    ) -> set[tuple[int, int]]:
    """The (layer, KV head) pairs chosen as retrieval heads on this calibration text."""
    chosen = choose_retrieval(head_scores(model, prompt, sink, window), ratio)
    return {(int(layer), int(head)) for layer, head in chosen.nonzero().tolist()}


def overlap(a: set, b: set) -> float:
    """The share of retrieval heads two calibrations have in common (of the larger set; 1.0 when both are empty)."""
    return len(a & b) / max(len(a), len(b)) if a or b else 1.0


def stability(model: LoadedModel, ratio: float, sink: int, window: int, tokens: int = CALIBRATION_TOKENS) -> dict:
    """How much the choice of retrieval heads depends on the calibration text: the heads chosen at `ratio` on the
    policy's calibration text (the CPython docs from their start) and on another passage of the same docs (from
    their middle), and their overlap (the share in common). Two passages of one corpus, the only offline text here:
    what it measures is the choice's sensitivity to the passage, not to the domain."""
    tokens = min(tokens, model.spec.max_context)
    first = prompt_of_length(model.tokenizer, tokens)
    other = prompt_of_length(model.tokenizer, tokens, offset=len(corpus_ids(model.tokenizer, tokens)) // 2)
    a, b = (retrieval_heads(model, text, ratio, sink, window) for text in (first, other))
    return {"retrieval_heads_chosen": len(a), "retrieval_heads_overlap": overlap(a, b)}
