"""What the ledger will book before anything runs: the device bytes of a full-matrix prefill of a model, and the
longest prompt that fits a device of a given size (the OOM boundary of paper Fig. 1, predicted from the shape).

The prediction books exactly what the engine books for the `full` policy with `prefill: full` (a test holds the two
equal): the weights; the KV cache reserved up front for the prompt plus the new tokens; the working set of one forward
pass (kvlib.engine.session.activation_bytes); and, inside it, one layer's attention matrix (kvlib.kernels.attention.matrix_bytes:
scores in the model's dtype plus fp32 probabilities, for every query head).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvlib.kernels.attention import matrix_bytes
from kvlib.models import LoadedModel, ModelSpec, model_config


def parameter_count(config) -> int:
    from kvlib.models.random_weights import meta_model

    return sum(p.numel() for p in meta_model(config).parameters())


def full_matrix_prefill_bytes(config, dtype: torch.dtype, prompt_tokens: int, max_new_tokens: int = 1) -> dict:
    """Peak device bytes by component while the `full` policy prefills one prompt with the attention matrix."""
    weights = parameter_count(config) * torch.empty((), dtype=dtype).element_size()
    return {"weights": weights, **_beyond_weights(config, dtype, prompt_tokens, max_new_tokens)}


def _beyond_weights(config, dtype: torch.dtype, prompt_tokens: int, max_new_tokens: int) -> dict:
    from kvlib.engine.session import activation_bytes

    spec = ModelSpec.from_config("", config, dtype)
    # activation_bytes reads only the model's config and spec: a shape stands in for the loaded model
    shape = LoadedModel("", SimpleNamespace(config=config), None, spec, torch.device("meta"))
    return {
        "kv_reserved": spec.kv_bytes(prompt_tokens + max_new_tokens),
        "activations": activation_bytes(shape, 1, prompt_tokens),
        "attention_matrix": matrix_bytes(1, spec.num_attention_heads, prompt_tokens, prompt_tokens, spec.dtype_bytes),
    }


def full_matrix_oom_boundary(model: str, capacity_bytes: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """The longest prompt whose full-matrix prefill fits capacity_bytes (0 if the weights alone do not fit; the
    model's context length if every prompt fits)."""
    config = model_config(model)
    weights = parameter_count(config) * torch.empty((), dtype=dtype).element_size()
    if weights > capacity_bytes:
        return 0

    def fits(tokens: int) -> bool:  # the weights counted once, not at every step of the search
        return weights + sum(_beyond_weights(config, dtype, tokens, 1).values()) <= capacity_bytes

    low, high = 0, config.max_position_embeddings - 1  # a prompt leaves room for its one new token
    if fits(high):
        return high
    while low + 1 < high:  # fits(low), not fits(high)
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low

