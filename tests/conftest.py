import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from kvlib.attention import register_attention
from kvlib.models import LoadedModel, ModelSpec, load_model


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    """The embedded SmolLM2-135M (converted from its GGUF once, then cached)."""
    return load_model("smollm2-135m", device="cpu")


def byte_tokenizer():
    """A byte-level tokenizer built here (no file, no model): one token per byte, id 256 the end of sequence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: i for i, char in enumerate(pre_tokenizers.ByteLevel.alphabet())} | {"<eos>": 256}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    """A 4-layer random Llama with GQA (4 query heads, 2 KV heads) and a byte-level tokenizer: fast unit tests that
    need nothing from the embedded model. Its vocabulary is SmolLM2's size, so prompts tokenized by SmolLM2 run too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    register_attention()
    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=1024, eos_token_id=tokenizer.eos_token_id)
    config._attn_implementation = "kvlib"
    model = LlamaForCausalLM(config).eval()
    return LoadedModel("tiny-llama", model, tokenizer, ModelSpec.from_config("tiny-llama", config, torch.float32),
                       torch.device("cpu"))


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
