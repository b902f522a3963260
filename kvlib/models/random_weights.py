"""A model built from its configuration with seeded random weights: the systems experiments at any model's shape.

No modeling file is copied: transformers' own classes are built from the config (`AutoModelForCausalLM.from_config`)
with kvlib's attention, as for a downloaded model; only the weights differ. What random weights cannot give is
meaning: outputs are not text, accuracy and retention cannot be measured, and which entries a sparse policy keeps or
fetches follows random attention, not a trained model's. Systems figures only.
"""

from __future__ import annotations

import torch

from kvlib.errors import UserError

# Each weight is its own seeded normal draw of this many values, repeated to the weight's size: a full i.i.d. draw
# costs ~4 ns a parameter on a CPU (70B: minutes), a repeat is a memory copy. Prime, so no two rows of any matrix
# with fewer rows than this are equal (row r starts at r x width mod PERIOD).
PERIOD = 4_194_301


def truncate_layers(config, num_layers: int | None):
    """The config with only its first num_layers decoder layers (every other dimension unchanged)."""
    if num_layers is None:
        return config
    full = config.num_hidden_layers
    if not 1 <= num_layers <= full:
        raise UserError(f"num_layers must be between 1 and {full}, got {num_layers}")
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    return config


def meta_model(config) -> torch.nn.Module:
    """The model's modules without memory behind them: to count its parameters or inspect its attention."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def unsupported_attention(config) -> list[str]:
    """What a model's attention does that kvlib's policies (which replace the attention computation) do not honour;
    empty when every policy computes the model's own attention."""
    found = []
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        found.append(f"sliding-window attention ({config.sliding_window} tokens) on some layers")
    if any(hasattr(m, "sinks") for m in meta_model(config).modules()):
        found.append("attention sinks (a learned per-head logit in the softmax denominator)")
    return found


def check_attention_supported(name: str, config) -> None:
    found = unsupported_attention(config)
    if found:
        raise UserError(f"model {name!r} ({config.model_type}) uses {' and '.join(found)}, which kvlib's policies do "
                        "not implement: they would compute a different attention than the model's")


@torch.no_grad()
def seeded_init(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter deterministically from seed: norms 1, biases 0, every other weight N(0, std^2) with the
    config's initializer_range (transformers' own init for these models)."""
    std = getattr(model.config, "initializer_range", 0.02)
    for i, (name, param) in enumerate(model.named_parameters()):
        if param.ndim == 1:
            param.fill_(1.0 if "norm" in name else 0.0)
            continue
        gen = torch.Generator(param.device).manual_seed(seed * 100_003 + i)
        block = torch.empty(min(PERIOD, param.numel()), dtype=param.dtype, device=param.device)
        block.normal_(0.0, std, generator=gen)
        flat = param.view(-1)
        for start in range(0, flat.numel(), PERIOD):
            flat[start:start + PERIOD] = block[:flat.numel() - start]


def build_random_model(config, dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from kvlib.kernels.attention import register_attention

    register_attention()
    # allocated on the target device in the target dtype, and left uninitialized until seeded_init: transformers'
    # own init would draw every weight in fp32 first (15 s for two 8B layers on a CPU)
    with torch.device(device), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="kvlib")
    seeded_init(model, seed)
    return model.eval()


CAVEAT = "random weights: systems figures only"
