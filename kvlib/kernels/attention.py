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


def attention_with_lse(query, key, value, scale: float, mask: torch.Tensor | None = None):
    """Attention of query [N, H, T, D] over key/value [N, H, L, D], and its log-sum-exp [N, H, T] (fp32): what merging
    partial attentions over disjoint key sets needs. mask: additive, broadcastable to [N, H, T, L] (-inf hides a key).
    A query with every key hidden has no defined result: the CPU flash kernel gives it output 0 and lse 0, not -inf,
    so callers discard such queries (paged_decode_attention's unfilled reader slots). On a CPU, PyTorch's flash kernel
    returns both and reads strided keys (a view into a block pool) in place."""
    if query.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, attn_mask=mask,
                                                                              scale=scale)[:2]
        return out, lse
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    return torch.matmul(probs.to(value.dtype), value), lse


def merge_segments(outs: torch.Tensor, lses: torch.Tensor, segments: torch.Tensor, rows: int) -> torch.Tensor:
    """Combine attentions over disjoint key sets into each row's attention over their union: part i (outs[i],
    lses[i]) belongs to row segments[i], and weighs exp(lse_i - the row's largest lse). A part with no keys (lse -inf)
    weighs 0, as long as its row has some part with keys; segments may name row `rows`, a part no row owns, which is
    dropped. Eight ops for the whole batch, however many parts a row has."""
    shape = (rows + 1, *lses.shape[1:])
    index = segments.view(-1, *[1] * (lses.dim() - 1)).expand_as(lses)
    top = lses.new_full(shape, float("-inf")).scatter_reduce_(0, index, lses, "amax")
    weight = torch.exp(lses - top.index_select(0, segments))
    total = weight.new_zeros(shape).index_add_(0, segments, weight)
    merged = outs.new_zeros(rows + 1, *outs.shape[1:]).index_add_(0, segments, outs * weight[..., None].to(outs.dtype))
    return merged[:rows] / total[:rows, ..., None].to(outs.dtype)


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
class SpanGroup:
    """Consecutive spans of `span` slots of a paged pool, attended in one call: span i of the group is read by the rows
    readers[i] ([spans, R]; the batch size where fewer than R rows read it), each over its own slots: mask
    [spans, 1, R x G, span], additive, one row of G queries per reader (G query heads per KV head); None where every
    slot is read."""

    first_slot: int
    span: int
    readers: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class PagedLayout:
    """Where a decode step's rows lie in a head-major pool [layers, Hkv, slots, D]: the pool cut into aligned spans,
    attended in place (groups), and the slots of every other token gathered (tail_index [B, W], padded; tail_mask
    [B, 1, 1, W], additive). segments: the row each part of the result belongs to (the groups' spans x readers, then
    the tail's rows, a row with no tail tokens as no row); lone_run: a lone row whose blocks are one run, the one
    group's single span (nothing to merge)."""

    groups: list[SpanGroup]
    tail_index: torch.Tensor | None
    tail_mask: torch.Tensor | None
    segments: torch.Tensor
    lone_run: bool = False

    def workspace_bytes(self, token_bytes: int, query_bytes: int) -> int:
        """What a decode step's attention holds beside the pool: this layout, and in each layer the tail's K and V
        copied out of the pool (token_bytes: one token's K or V) and each span's gathered queries (query_bytes: one
        row's)."""
        plan = [self.tail_index, self.tail_mask, self.segments] + [t for g in self.groups for t in (g.readers, g.mask)]
        gathered = 0 if self.tail_index is None else 2 * self.tail_index.numel() * token_bytes
        gathered += sum(g.readers.numel() for g in self.groups) * query_bytes
        return gathered + sum(t.nbytes for t in plan if t is not None)


def paged_decode_attention(query, keys, values, layout: PagedLayout, scale: float, layer: int = 0) -> torch.Tensor:
    """One decode step's attention over a paged pool, read in place: query [B, Hq, 1, D]; keys/values
    [layers, Hkv, slots, D] (head-major: a span of slots is one contiguous stretch per head).

    A lone row in one run is one SDPA call over its slots, as `full` attends a row. Otherwise GQA is folded into the
    query length (each KV head's G query heads are G queries), so the keys are read once per KV head, and each group
    of spans is one call over a strided view of the pool (no copy, no padding to the longest row): a span is a batch
    element, its queries those of the rows holding tokens in it, each masked to its own slots. The gathered tail is
    one masked call for the whole batch, and every part is merged by log-sum-exp (merge_segments). Returns
    [B, Hq, 1, D].
    """
    b, hq, _, d = query.shape
    hkv = keys.shape[1]
    if layout.lone_run:
        # GQA unfolded: Hq work items for the flash kernel, not Hkv (one row of 265-1,024 tokens: 48-168 against
        # 73-206 us a layer folded, 2 threads)
        first, n = layout.groups[0].first_slot, layout.groups[0].span
        k, v = (c[layer, :, first:first + n][None] for c in (keys, values))
        return fused_attention(query, k, v, None, scale)
    g = hq // hkv
    q = query.reshape(b, hkv, g, d)
    padded_q = torch.cat([q, q.new_zeros(1, hkv, g, d)])  # what a reader slot that no row fills reads
    outs, lses = [], []
    for group in layout.groups:
        n, r = group.readers.shape
        span_q = padded_q.index_select(0, group.readers.flatten()).view(n, r, hkv, g, d).transpose(1, 2)
        span_q = span_q.reshape(n, hkv, r * g, d)
        k, v = (c[layer, :, group.first_slot:group.first_slot + n * group.span].view(hkv, n, group.span, d)
                .transpose(0, 1) for c in (keys, values))
        out, lse = attention_with_lse(span_q, k, v, scale, group.mask)
        outs.append(out.reshape(n, hkv, r, g, d).transpose(1, 2).reshape(n * r, hkv, g, d))
        lses.append(lse.reshape(n, hkv, r, g).transpose(1, 2).reshape(n * r, hkv, g))
    if layout.tail_index is not None:
        w = layout.tail_index.shape[1]
        k, v = (c[layer].index_select(1, layout.tail_index.flatten()).view(hkv, b, w, d).transpose(0, 1)
                for c in (keys, values))
        out, lse = attention_with_lse(q, k, v, scale, layout.tail_mask)
        outs.append(out)
        lses.append(lse)
    return merge_segments(torch.cat(outs), torch.cat(lses), layout.segments, b).view(b, hq, 1, d)
