"""How kvlib plugs into transformers, and the attention kernels policies share.

The model's own attention modules project Q/K/V and apply RoPE; the function registered here under the name
"kvlib" hands those tensors to the active KV policy, which stores K/V its own way and computes attention over what
it keeps. No modeling file is copied, so any transformers model whose attention goes through AttentionInterface works.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def kvlib_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, kv_step=None, **kwargs):
    if kv_step is None:  # the model called outside the engine (e.g. a plain forward): behave like SDPA
        out = F.scaled_dot_product_attention(query, key, value, is_causal=query.shape[2] > 1, scale=scaling,
                                             enable_gqa=True)
    else:
        out = kv_step.policy.attend(module.layer_idx, query, key, value, kv_step)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    from transformers import AttentionInterface

    # Not registering a mask function makes transformers skip building masks: each policy builds its own.
    AttentionInterface.register("kvlib", kvlib_attention)


def causal_mask(q_len: int, kv_len: int, device) -> torch.Tensor:
    """Boolean [q_len, kv_len] mask, True = visible; the queries are the last q_len of the kv_len positions."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    return torch.arange(kv_len, device=device)[None, :] <= q_pos


DECODE_LENGTH_STEP = 128


def decode_mask(start: torch.Tensor, capacity: int, device) -> tuple[torch.Tensor, int]:
    """(visible [B, 1, 1, L], L) for a decode step whose new tokens sit at positions start [B], over a contiguous
    per-row cache of `capacity` slots. On CUDA, L is the longest row rounded up to a multiple of DECODE_LENGTH_STEP
    (the mask hides the extra slots): a length that grows by one every step would be a new shape every step, and SDPA's
    cuDNN backend builds a plan per shape (profiled on an H100: 2.1 ms of CPU per call against 0.08 ms for paged
    blocks' stable lengths; full-cache decode went from 24 to 105 tok/s once the plans were cached). A CPU kernel
    has no such plans: there L is the longest row, and no work is wasted on masked slots."""
    step = DECODE_LENGTH_STEP if torch.device(device).type == "cuda" else 1
    length = min(capacity, -(-(int(start.max()) + 1) // step) * step)
    visible = torch.arange(length)[None, :] <= start[:, None]
    return visible[:, None, None, :].to(device), length


def grouped_scores(query: torch.Tensor, key: torch.Tensor, scale: float) -> torch.Tensor:
    """Q [B, Hq, T, D] x K [B, Hkv, L, D] -> scores [B, Hkv, G, T, L] without repeating K for GQA."""
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    q = query.view(b, hkv, hq // hkv, t, d)
    return torch.matmul(q, key.unsqueeze(2).transpose(-1, -2)) * scale


def matrix_attention(query, key, value, mask: torch.Tensor | None, scale: float):
    """Attention that materializes the probability matrix, as H2O's scoring needs.

    mask: boolean, broadcastable to [B, 1, 1, T, L] (True = visible). Returns (output [B, Hq, T, D],
    probabilities [B, Hkv, G, T, L]).
    """
    scores = grouped_scores(query, key, scale)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, value.unsqueeze(2))  # [B, Hkv, G, T, D]
    b, hkv, g, t, d = out.shape
    return out.reshape(b, hkv * g, t, d), probs


def fused_attention(query, key, value, mask: torch.Tensor | None, scale: float, causal: bool = False):
    """SDPA (flash / memory-efficient kernels where available): no T x L matrix is kept.

    mask: boolean broadcastable to [B, 1, T, L] (True = visible), or None with causal=True for a pure prefill.
    """
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal and mask is None,
                                          scale=scale, enable_gqa=True)


def attention_with_lse(query, key, value, scale: float):
    """Attention of query [1, H, T, D] over key/value [1, H, L, D] (no mask), and its log-sum-exp [1, H, T] (fp32):
    what merging partial attentions over disjoint key sets needs. On a CPU, PyTorch's flash kernel returns both and
    reads strided keys (a view into a block pool) in place."""
    if query.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, scale=scale)[:2]
        return out, lse
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]).to(value.dtype), value), lse


def merge_by_lse(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attentions over disjoint key sets into the attention over their union. Folded a part at a time: what is
    merged so far keeps its share of the pair's softmax mass, sigmoid(lse - lse_i) (5 small ops a pair, against ~12
    for weighting every part by exp(lse_i - logsumexp)). A part with no keys has lse = -inf and output 0: it weighs 0,
    and two of them give 0."""
    out, lse = outs[0], lses[0]
    for part, part_lse in zip(outs[1:], lses[1:]):
        share = torch.sigmoid(lse - part_lse).nan_to_num(0.0)[..., None].to(part.dtype)
        out = part + share * (out - part)
        lse = torch.logaddexp(lse, part_lse)
    return out, lse


def masked_attention_with_lse(query, key, value, visible: torch.Tensor, scale: float):
    """query [B, H, T, D] over key/value [B, H, L, D] where visible [B, L]; rows with nothing visible get lse -inf
    and output 0."""
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    return torch.matmul(probs.to(value.dtype), value), lse


def matrix_bytes(batch: int, heads: int, q_len: int, kv_len: int, dtype_bytes: int) -> int:
    """Workspace of matrix attention: scores and probabilities (fp32 softmax) for one layer."""
    return batch * heads * q_len * kv_len * (dtype_bytes + 4)


def prefill_attention(query, key, value, begin: int, mode: str, scale: float, ledger, layer: int):
    """Attention of a prompt chunk (queries at positions begin..begin+T) over the row's cached keys [1, Hkv, L, D].

    `full` materializes the matrix (booked in the ledger as activations: this is where long prompts hit the memory
    wall); `fused` and `chunked` use SDPA.
    """
    t, end = query.shape[2], key.shape[2]
    if mode == "full":
        nbytes = matrix_bytes(1, query.shape[1], t, end, key.element_size())
        with ledger.transient("device", "activations", nbytes, where=f"attention matrix, layer {layer}"):
            out, _ = matrix_attention(query, key, value, causal_mask(t, end, query.device), scale)
        return out
    if begin == 0:
        return fused_attention(query, key, value, None, scale, causal=True)
    return fused_attention(query, key, value, causal_mask(t, end, query.device), scale)


@dataclass
class PagedLayout:
    """Where a decode step's rows lie in a token-major pool [layers, slots, Hkv, D]: per row, the runs of slots read in
    place ((first slot, tokens)); the slots of every other token, gathered ([B, W], padded; visible [B, W])."""

    runs: list[list[tuple[int, int]]]
    tail_index: torch.Tensor | None
    tail_visible: torch.Tensor | None
    views: list[list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    def run_views(self, keys: torch.Tensor, values: torch.Tensor) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Each run as K and V views over every layer, [layers, Hkv, n, D], made once a step: a layer then takes its
        slice in one op (per row and layer, the Python around a ~20-70 us attention call is what paged pays)."""
        if self.views is None:
            self.views = [[(keys[:, first:first + n].transpose(1, 2), values[:, first:first + n].transpose(1, 2))
                           for first, n in row] for row in self.runs]
        return self.views


def paged_decode_attention(query, keys, values, layout: PagedLayout, scale: float, layer: int = 0) -> torch.Tensor:
    """One decode step's attention over a paged pool, read in place: query [B, Hq, 1, D]; keys/values
    [layers, slots, Hkv, D].

    GQA is folded into the query length (each KV head's G query heads are G queries), so every call is plain
    multi-head attention and the keys are read once per KV head. Each row attends each of its in-place runs (a
    strided view, no copy, no padding), the whole batch its gathered tail in one masked call, and the parts are merged
    by log-sum-exp. Returns [B, Hq, 1, D].
    """
    b, hq, _, d = query.shape
    hkv = keys.shape[2]
    q = query.reshape(b, hkv, hq // hkv, d)
    outs, lses = [], []
    for q_row, runs in zip(q.split(1), layout.run_views(keys, values)):
        parts = [attention_with_lse(q_row, k[layer:layer + 1], v[layer:layer + 1], scale) for k, v in runs]
        if not parts:  # every token of this row is in the tail
            parts = [(torch.zeros_like(q_row), torch.full(q_row.shape[:3], float("-inf"), device=q.device))]
        out, lse = merge_by_lse([o for o, _ in parts], [s for _, s in parts])
        outs.append(out)
        lses.append(lse)
    out, lse = torch.cat(outs), torch.cat(lses)
    if layout.tail_index is not None:
        w = layout.tail_index.shape[1]
        k, v = (c[layer].index_select(0, layout.tail_index.flatten()).view(b, w, hkv, d).transpose(1, 2)
                for c in (keys, values))
        tail, tail_lse = masked_attention_with_lse(q, k, v, layout.tail_visible, scale)
        out, _ = merge_by_lse([out, tail], [lse, tail_lse])
    return out.view(b, hq, 1, d)
