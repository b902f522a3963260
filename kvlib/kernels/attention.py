"""How kvlib plugs into transformers, and the attention kernels policies share.

The model's own attention modules project Q/K/V and apply RoPE; the function registered here under the name
"kvlib" hands those tensors to the active KV policy, which stores K/V its own way and computes attention over what
it keeps. No modeling file is copied, so any transformers model whose attention goes through AttentionInterface works.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kvlib_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, kv_step=None, one_pass=None,
                    **kwargs):
    if one_pass is not None:  # the official accuracy harnesses' masked pass (kvlib.evaluation.one_pass)
        return masked_attention(module, query, key, value, scaling, *one_pass), None
    if kv_step is None:  # the model called outside the engine (e.g. a plain forward): behave like SDPA
        out = F.scaled_dot_product_attention(query, key, value, is_causal=query.shape[2] > 1, scale=scaling,
                                             enable_gqa=True)
    else:
        out = kv_step.policy.attend(module.layer_idx, query, key, value, kv_step)
    return out.transpose(1, 2).contiguous(), None


def masked_attention(module, query, key, value, scaling, policy, counter=None) -> torch.Tensor:
    """A layer's attention over the whole sequence, each query row [B, Hq, T, D] attending what the policy's one-pass
    rule keeps for it (KVPolicy.one_pass_keep), causally; output [B, T, Hq, D] as an attention function returns it.
    counter (kvlib.evaluation.one_pass.Counter): adds what its scored rows attended."""
    b, heads, t, _ = query.shape
    causal = torch.ones(t, t, dtype=torch.bool, device=query.device).tril()
    scores = grouped_scores(query, key, scaling).view(b, heads, t, t).masked_fill_(~causal, float("-inf"))
    keep = policy.one_pass_keep(module.layer_idx, query, key, scores)
    keep = causal.expand_as(scores) if keep is None else keep & causal
    if counter is not None and counter.rows is not None:
        counter.add(keep)
    probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs.view(b, key.shape[1], -1, t, t), value.unsqueeze(2))  # [B, Hkv, G, T, D]
    return out.reshape(b, heads, t, -1).transpose(1, 2).contiguous()


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
    return torch.matmul(q, key.unsqueeze(2).transpose(-1, -2)).mul_(scale)  # in place: one [T, L] buffer, not two


def matrix_attention(query, key, value, mask: torch.Tensor | None, scale: float):
    """Attention that materializes the probability matrix, as H2O's scoring needs.

    mask: boolean, broadcastable to [B, 1, 1, T, L] (True = visible). Returns (output [B, Hq, T, D],
    probabilities [B, Hkv, G, T, L]).
    """
    scores = grouped_scores(query, key, scale)
    if mask is not None:  # in place, as the scale: a third of the matrix's time at 1,024 tokens went to copies
        scores.masked_fill_(mask.logical_not(), float("-inf"))
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
