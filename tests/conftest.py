import os
import sys
from pathlib import Path

# the tests are folded by kvlib's packages (tests/README.md); a test imports a helper (policy_examples, ray_fakes,
# kernel_cases) or another test's cases by module name, from whichever folder
sys.path[:0] = [str(folder) for folder in sorted(Path(__file__).parent.iterdir())
                if folder.is_dir() and folder.name not in ("data", "__pycache__")]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from kvlib.kernels.attention import register_attention
from kvlib.models import LoadedModel, ModelSpec, load_model


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    """The embedded SmolLM2-135M (converted from its GGUF once, then cached)."""
    return load_model("smollm2-135m", device="cpu")


@pytest.fixture(scope="session")
def tiny(smollm) -> LoadedModel:
    """A 4-layer random Llama with GQA (4 query heads, 2 KV heads) and SmolLM2's tokenizer: fast unit tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    register_attention()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=smollm.model.config.vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=1024, eos_token_id=smollm.tokenizer.eos_token_id)
    config._attn_implementation = "kvlib"
    model = LlamaForCausalLM(config).eval()
    return LoadedModel("tiny-llama", model, smollm.tokenizer, ModelSpec.from_config("tiny-llama", config,
                                                                                   torch.float32), torch.device("cpu"))


@pytest.fixture(scope="session")
def fused(tiny):
    """The tiny Llama as the book runs SmolLM2: Q/K/V and gate/up fused, linears prepacked, kvlib's own forward (the
    one that streams weights)."""
    from transformers import LlamaForCausalLM

    from kvlib.models import LoadedModel
    from kvlib.models.loading import speed_up_for_cpu

    torch.manual_seed(0)
    model = LoadedModel("tiny-fused", LlamaForCausalLM(tiny.model.config).eval(), tiny.tokenizer, tiny.spec,
                        tiny.device)
    speed_up_for_cpu(model)
    assert model.kvlib_forward is not None
    return model


@pytest.fixture(scope="session")
def mixed_prompts(smollm) -> list[list[int]]:
    """Three prompts of different lengths (real text, tokenized as-is)."""
    texts = ["The capital of France is",
             "Once upon a time, in a land far away, there lived a dragon who guarded a mountain of gold and",
             "def fibonacci(n):\n    "]
    return [smollm.tokenizer(t)["input_ids"] for t in texts]


def hf_greedy(loaded: LoadedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Reference: transformers' own generate (greedy, DynamicCache, SDPA), one prompt at a time (no padding)."""
    model = loaded.model
    saved = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"
    try:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=loaded.tokenizer.eos_token_id)
    finally:
        model.config._attn_implementation = saved
    return out[0, len(prompt):].tolist()


@pytest.fixture(params=["c", "torch"])
def kernel(request, monkeypatch):
    """Each decode attention in turn: kvlib's C kernel (where it can be built) and the PyTorch path every other
    machine runs."""
    from kvlib.kernels import cpu_kernel

    if request.param == "torch":
        monkeypatch.setenv(cpu_kernel.KERNEL_ENV, "torch")
    elif not cpu_kernel.available():
        pytest.skip("no C compiler: the kernel is not built")
    return request.param

