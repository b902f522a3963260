"""What one forward pass of a model reads and computes outside attention, and what attention costs per token read:
counted from the model's modules (a meta model of its config), so a published shape is counted as a loaded model is
(kvlib.memory.work counts a run's passes with it; kvlib.projection books a shape with it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PassShape:
    """A model's work per pass outside attention, from its modules' shapes (a meta model's do as well as a loaded
    one's: kvlib.projection books a published shape the same way)."""

    weight_bytes: int  # every weight once, less an embedding table that is not also the LM head (only rows are read)
    row_bytes: int  # one token's embedding row
    linear_params: int  # the decoder layers' linear weights: 2 FLOPs each, per token
    head_params: int  # the LM head's: 2 FLOPs each, per row (the last position's logits only)
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    @classmethod
    def of(cls, config, dtype_bytes: int) -> PassShape:
        """From a transformers config, through its modules without memory (a meta model): the same count for a
        published shape as for a loaded model, whatever kvlib made of the loaded one's modules (fused, prepacked)."""
        from kvlib.models.random_weights import meta_model

        model = meta_model(config)
        embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        total = sum(p.numel() for p in model.parameters())  # (parameters() yields a tied weight once)
        linear = sum(m.weight.numel() for m in model.modules()
                     if isinstance(m, torch.nn.Linear) and m.weight is not head)
        heads = config.num_attention_heads
        return cls(weight_bytes=(total - (0 if embed is head else embed.numel())) * dtype_bytes,
                   row_bytes=embed.shape[1] * dtype_bytes, linear_params=linear, head_params=head.numel(),
                   num_layers=config.num_hidden_layers, num_attention_heads=heads,
                   num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads, dtype_bytes=dtype_bytes)

    @property
    def kv_token_bytes(self) -> int:
        """One token's key and value, one KV head of one layer."""
        return 2 * self.head_dim * self.dtype_bytes

    def pass_work(self, rows: int, q_len: int) -> dict:
        """A forward pass of `rows` rows of q_len new tokens, outside attention."""
        return {"passes": 1, "weight_bytes": self.weight_bytes + rows * q_len * self.row_bytes,
                "linear_flops": 2 * self.linear_params * rows * q_len + 2 * self.head_params * rows}

    def attention_work(self, tokens_read: int, query_keys: int) -> dict:
        """Attention over `tokens_read` (row, KV head, layer) tokens read and `query_keys` (row, query head, layer,
        query) x key products: QK^T and PV, 2 FLOPs a multiply-add each."""
        return {"kv_read_bytes": tokens_read * self.kv_token_bytes, "attention_flops": 4 * self.head_dim * query_keys}

    def dense_prefill(self, start: int, q_len: int) -> dict:
        """A prefill chunk of q_len queries after `start` cached tokens, dense and causal: each layer reads the row's
        start + q_len keys and values once (a fused kernel), query i attends start + i + 1 keys."""
        pairs = q_len * start + q_len * (q_len + 1) // 2
        return self.attention_work(self.num_layers * self.num_kv_heads * (start + q_len),
                                   self.num_layers * self.num_attention_heads * pairs)

    def decode_step(self, rows: int, attended: int) -> dict:
        """A decode step of `rows` rows reading `attended` tokens per (row, layer, KV head) on average, dense: the
        weights, the linears, attention. What a projection at a published shape starts from."""
        group = self.num_attention_heads // self.num_kv_heads
        read = rows * self.num_layers * self.num_kv_heads * attended
        return add(self.pass_work(rows, 1), self.attention_work(read, read * group))


def add(*parts: dict) -> dict:
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            out[key] = out.get(key, 0) + value
    return out
