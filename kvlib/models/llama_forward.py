"""kvlib's own modules and forward pass for Llama-family models (Llama, and Qwen2: the same layers with biases on Q, K
and V), beside transformers' (book/methods.md, "The engine").

A decode step of a small model on a CPU is a few milliseconds of matmuls wrapped in a few thousand small ops and
Python calls: transformers' decoder layers pass a dozen keyword arguments through decorators, and its RMSNorm and
RoPE are six and a dozen ops. What is here, written for kvlib rather than copied:

- GatedMLP and FusedAttention: an MLP with gate and up as one linear layer, an attention with Q, K and V as one. They
  replace transformers' modules in the model and keep their contracts, so the model stays a transformers model (its
  own forward, `generate` with its cache, hooks on `self_attn` all work).
- LlamaForward: the model's pass itself (embedding, RoPE, decoder layers, final norm, the last position's logits)
  over those modules, the residual add folded into the next RMSNorm.
- The layer's small ops (RMSNorm, RoPE, SiLU-and-multiply) run as one call each to kvlib's C kernels on a CPU in fp32
  (kvlib.kernels.cpu_kernel), as PyTorch's ops elsewhere.

A model of any other shape (not Llama-family, not fused, not fp32) runs transformers' forward: the general fallback.
"""

from __future__ import annotations

import inspect
import sys

import torch
import torch.nn.functional as F

from kvlib.errors import UserError
from kvlib.kernels import cpu_kernel


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as Llama applies it (x cos + rotate_half(x) sin), the same ops in the same order as transformers."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    """The residual stream x += delta (in place; none before the first layer), then x through RMSNorm (weight, eps)."""
    weight, eps = norm
    if cpu_kernel.runs_layer_ops(x, x.shape[-1]) and (delta is None or delta.is_contiguous()):
        return cpu_kernel.add_rms_norm(x, delta, weight, eps)
    if delta is not None:
        x += delta
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if cpu_kernel.runs_layer_ops(gate_up, gate_up.shape[-1] // 2):
        return cpu_kernel.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def replace_modules(model: torch.nn.Module, matches, replacement) -> int:
    """Swap every submodule for which matches(module) holds for replacement(module), in place. Returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if matches(child):
                setattr(parent, name, replacement(child))
                swapped += 1
    return swapped


class GatedMLP(torch.nn.Module):
    """A Llama-family MLP, down(act(gate(x)) * up(x)), with gate and up as one linear layer: one matmul of twice the
    width instead of two. SmolLM2's 30 MLPs, prepacked, 2 threads, best of 9: 11.3-12.6 vs 12.1-13.6 ms at 1 row,
    14.9-15.1 vs 17.0-17.5 at 8 rows, 20.4-20.7 vs 22.5-22.6 at 16 (this host in a slow phase). The same weights
    and bytes; the wider matmul may sum in another order (tests/models/test_forward.py)."""

    def __init__(self, mlp: torch.nn.Module):
        super().__init__()
        gate, up = mlp.gate_proj, mlp.up_proj
        self.gate_up = torch.nn.Linear(gate.in_features, 2 * gate.out_features, bias=gate.bias is not None,
                                       device=gate.weight.device, dtype=gate.weight.dtype)
        with torch.no_grad():
            self.gate_up.weight.copy_(torch.cat([gate.weight, up.weight]))
            if gate.bias is not None:
                self.gate_up.bias.copy_(torch.cat([gate.bias, up.bias]))
        self.down_proj, self.act_fn = mlp.down_proj, mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def fuse_gate_up(model: torch.nn.Module) -> int:
    """Swap every Llama-family MLP (gate_proj, up_proj, down_proj, act_fn; plain linear layers) for a GatedMLP, one
    layer at a time (the separate weights are freed as each is replaced). Returns how many were swapped."""
    def is_mlp(m):
        parts = [getattr(m, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
        return all(type(p) is torch.nn.Linear for p in parts) and hasattr(m, "act_fn")

    return replace_modules(model, is_mlp, GatedMLP)


class FusedAttention(torch.nn.Module):
    """A Llama-family attention whose Q, K and V projections are one linear layer: one matmul of (Hq + 2 Hkv) x D
    outputs instead of three, the same weights and bytes. It keeps the contract of the module it replaces: called
    with transformers' arguments, it updates a transformers cache where one is passed and attends through the
    model's registered attention function (kvlib's inside the engine, SDPA for transformers' `generate`)."""

    def __init__(self, attn: torch.nn.Module, config):
        super().__init__()
        q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
        self.config, self.layer_idx, self.scaling, self.head_dim = config, attn.layer_idx, attn.scaling, attn.head_dim
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_key_value_groups, self.is_causal = self.heads // self.kv_heads, True  # what attention functions read
        self.attention_dropout = getattr(attn, "attention_dropout", 0.0)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # (loaded with the model already)

        self.attention_functions = ALL_ATTENTION_FUNCTIONS
        self.eager_attention = sys.modules[type(attn).__module__].eager_attention_forward
        self.qkv_proj = torch.nn.Linear(q.in_features, q.out_features + k.out_features + v.out_features,
                                        bias=q.bias is not None, device=q.weight.device, dtype=q.weight.dtype)
        with torch.no_grad():
            self.qkv_proj.weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
            if q.bias is not None:
                self.qkv_proj.bias.copy_(torch.cat([q.bias, k.bias, v.bias]))
        self.o_proj = attn.o_proj

    def project(self, hidden: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q [B, Hq, T, D] and K [B, Hkv, T, D] with RoPE applied, and V [B, Hkv, T, D]: views, as transformers' are."""
        b, t, _ = hidden.shape
        qk_heads = self.heads + self.kv_heads
        qkv = self.qkv_proj(hidden)
        cos, sin = position_embeddings
        qk = qkv[..., :qk_heads * self.head_dim].view(b, t, qk_heads, self.head_dim)
        if cpu_kernel.runs_layer_ops(qkv, self.head_dim // 2) and cos.is_contiguous() and sin.is_contiguous():
            cpu_kernel.rope_(qkv, qk_heads, self.head_dim, cos, sin)
        else:
            qk = rotate(qk, cos[:, :, None], sin[:, :, None])
        value = qkv[..., qk_heads * self.head_dim:].view(b, t, self.kv_heads, self.head_dim)
        return qk[:, :, :self.heads].transpose(1, 2), qk[:, :, self.heads:].transpose(1, 2), value.transpose(1, 2)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        query, key, value = self.project(hidden_states, position_embeddings)
        # transformers 5.2x renamed past_key_values to cache and hands update the call's arguments; take either
        cache, old_name = kwargs.pop("cache", None), kwargs.pop("past_key_values", None)
        cache = old_name if cache is None else cache
        if cache is not None:
            passes = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(cache.update).parameters.values())
            key, value = cache.update(key, value, self.layer_idx, **({"kwargs": kwargs} if passes else {}))
        attend = self.attention_functions.get_interface(self.config._attn_implementation, self.eager_attention)
        out, weights = attend(self, query, key, value, attention_mask, scaling=self.scaling,
                              dropout=self.attention_dropout if self.training else 0.0, **kwargs)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), weights


# model_type -> its attention class in transformers: decoder layers of RMSNorm, attention with rotate-half RoPE after
# the projections, RMSNorm, a gated SiLU MLP. Qwen2 differs from Llama by biases on Q, K and V (fused with their
# weights) and an optional sliding window (layers with one keep transformers' module, see is_llama_attention).
LLAMA_FAMILY = {"llama": "LlamaAttention", "qwen2": "Qwen2Attention"}


def is_llama_attention(module: torch.nn.Module) -> bool:
    """transformers' attention of a Llama-family model with plain linear projections, attending every earlier token:
    the module whose contract FusedAttention keeps. A sliding-window layer is not one: FusedAttention has no window."""
    parts = [getattr(module, p, None) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    return (type(module).__name__ in LLAMA_FAMILY.values() and all(type(p) is torch.nn.Linear for p in parts)
            and getattr(module, "sliding_window", None) is None)


def fuse_qkv(model: torch.nn.Module) -> int:
    """Swap every Llama-family attention module of a model for a FusedAttention. Returns how many were swapped."""
    return replace_modules(model, is_llama_attention, lambda m: FusedAttention(m, model.config))


def attention_modules(model, policy: str) -> list:
    """Each decoder layer's attention module of a Llama-family model (its self_attn with a q_proj, or kvlib's fused
    attention): what a policy that reads the queries hooks; a clear error for another architecture."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    modules = [getattr(layer, "self_attn", None) for layer in layers or []]
    if not modules or not all(isinstance(m, FusedAttention) or hasattr(m, "q_proj") for m in modules):
        raise UserError(f"policy {policy!r} needs a model whose decoder layers have self_attn.q_proj "
                        f"(Llama-family attention); {type(model).__name__} does not")
    return modules


class QueryProjection(torch.nn.Module):
    """The query alone of a Llama attention module, RoPE applied: [B, Hq, T, D] from hidden [B, T, hidden] at these
    positions (InfiniGen speculates the next layer's attention with it). A fused Q/K/V projection is prepacked whole
    and cannot be sliced, so this holds its own copy of the query's rows, in the same layout: the bytes of one
    query weight, for a matmul 1 + 2 Hkv / Hq times narrower than the fused one."""

    def __init__(self, attn: torch.nn.Module):
        super().__init__()
        self.head_dim, self.copied_bytes = attn.head_dim, 0  # bytes of weights held beside the model's own
        if not isinstance(attn, FusedAttention):
            self.linear = attn.q_proj
            return
        qkv, width = attn.qkv_proj, attn.heads * attn.head_dim
        dense = qkv.dense_weight() if hasattr(qkv, "dense_weight") else qkv.weight
        linear = torch.nn.Linear(dense.shape[1], width, bias=qkv.bias is not None, device=dense.device,
                                 dtype=dense.dtype)
        with torch.no_grad():
            linear.weight.copy_(dense[:width])
            if qkv.bias is not None:
                linear.bias.copy_(qkv.bias[:width])
        self.linear = linear if type(qkv) is torch.nn.Linear else type(qkv)(linear)  # packed as the fused one is
        self.copied_bytes = sum(p.numel() * p.element_size() for p in self.linear.parameters())

    def forward(self, hidden: torch.Tensor, position_embeddings) -> torch.Tensor:
        b, t, _ = hidden.shape
        q = self.linear(hidden)
        heads = q.shape[-1] // self.head_dim
        cos, sin = position_embeddings
        if cpu_kernel.runs_layer_ops(q, self.head_dim // 2) and cos.is_contiguous() and sin.is_contiguous():
            cpu_kernel.rope_(q, heads, self.head_dim, cos, sin)
            return q.view(b, t, heads, self.head_dim).transpose(1, 2)
        return rotate(q.view(b, t, heads, self.head_dim), cos[:, :, None], sin[:, :, None]).transpose(1, 2)


class LlamaForward:
    """One forward pass of a Llama-family model whose layers are [RMSNorm, FusedAttention, RMSNorm, GatedMLP (SiLU)]:
    the same modules and weights transformers' forward runs, without its per-layer argument handling, the residual add
    folded into the next RMSNorm (tests/models/test_llama_forward.py)."""

    def __init__(self, model: torch.nn.Module):
        inner = model.model
        self.embed, self.rotary, self.lm_head = inner.embed_tokens, inner.rotary_emb, model.lm_head
        self.norm = (inner.norm.weight, inner.norm.variance_epsilon)
        self.layers = [((layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon), layer.self_attn,
                        (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
                        layer.mlp) for layer in inner.layers]
        self.streamer = None  # a decoder layer's weights brought to the device around it (offloaded_weights)

    @staticmethod
    def of(model: torch.nn.Module) -> LlamaForward | None:
        """kvlib's forward pass over this model, or None where transformers' forward must run it."""
        inner = getattr(model, "model", None)
        if getattr(model.config, "model_type", None) not in LLAMA_FAMILY or not hasattr(inner, "layers"):
            return None
        if next(model.parameters()).dtype != torch.float32 or getattr(model.config, "hidden_act", None) != "silu":
            return None  # (transformers' RMSNorm rounds to the dtype before its weight, F.rms_norm after)
        for layer in inner.layers:
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if not (isinstance(layer.self_attn, FusedAttention) and type(layer.mlp) is GatedMLP
                    and all(hasattr(n, "variance_epsilon") for n in norms)):
                return None
        return LlamaForward(model)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, step) -> torch.Tensor | None:
        """Logits [B, V] after the last of the [B, T] new tokens at positions position_ids [B, T] (None where the
        step's logits are not read: step.logits). A pass cut into
        micro-batches (step.parts) runs each layer on each part in turn, the layer's weights brought to the device once
        for all of them (FlexGen's zig-zag over a block of GPU batches); each part keeps its own hidden state."""
        x = self.embed(input_ids)
        cos, sin = self.rotary(x, position_ids)
        parts = [(p, x[p.index], (cos[p.index], sin[p.index])) for p in step.parts] if step.parts else \
            [(step, x, (cos, sin))]
        deltas = [None] * len(parts)
        streamer = self.streamer
        for i, (norm1, attn, norm2, mlp) in enumerate(self.layers):
            if streamer is not None:
                streamer.before(i)
            for k, (part, h, position_embeddings) in enumerate(parts):
                delta = attn(hidden_states=add_rms_norm(h, deltas[k], norm1), position_embeddings=position_embeddings,
                             kv_step=part)[0]
                deltas[k] = mlp.down_proj(silu_mul(mlp.gate_up(add_rms_norm(h, delta, norm2))))
            if streamer is not None:
                streamer.after(i)
        if not step.logits:
            return None
        logits = [self.lm_head(add_rms_norm(h[:, -1] + d[:, -1], None, self.norm)) for (_, h, _), d in zip(parts, deltas)]
        if not step.parts:
            return logits[0]
        out = logits[0].new_empty(len(step.rows), logits[0].shape[-1])
        for (part, _, _), part_logits in zip(parts, logits):
            out[part.index] = part_logits
        return out
