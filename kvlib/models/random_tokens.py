"""Prompts without a tokenizer: seeded random token ids, for models with random weights (no text means anything
to them, and a named architecture ships no tokenizer)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvlib.errors import UserError

RANDOM_IDS = {"kind": "random_ids"}
STREAM = 2**20  # prompts are cut from one seeded stream of ids, as text prompts are cut from one corpus


@functools.lru_cache(maxsize=4)
def _stream(vocab_size: int, seed: int, length: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=gen)


def random_token_ids(vocab_size: int, tokens: int, offset: int = 0, seed: int = 0) -> list[int]:
    """`tokens` ids in [0, vocab_size), the same for the same (tokens, offset, seed); prompts at one offset share
    their prefix, as prompts cut from one text do."""
    ids = _stream(vocab_size, seed, max(STREAM, tokens))
    start = offset % (len(ids) - tokens + 1)
    return ids[start:start + tokens].tolist()


@dataclass(frozen=True)
class NoTextTokenizer:
    """Stands in for a tokenizer where a model has random weights: it knows the vocabulary size and nothing else."""

    model: str
    vocab_size: int
    # no end of sequence: every request decodes its full length, so random weights never change the work done
    eos_token_id = None

    def __len__(self) -> int:
        return self.vocab_size

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return f"<{len(ids)} token ids; random weights: no text>"

    def __call__(self, *args, **kwargs):
        raise UserError(f"model {self.model!r} has random weights and no tokenizer: its prompts are random token ids "
                        "(`--prompt-tokens N`; in a profile, no text_source or {kind: random_ids}), not text")

    apply_chat_template = __call__
