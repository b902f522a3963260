"""Prompts for the experiments: exact token lengths cut from real text.

Offline profiles use the CPython documentation that ships with every Python (`pydoc_data.topics`); the paper profile
streams English Wikipedia (20220301.en) or LMSYS-Chat-1M through `datasets`. Any Hugging Face dataset spec works the
same way, which is how the hub path is tested on a local stand-in (`{"path": "json", "data_files": ...}`). A model
with random weights has no tokenizer: its prompts are seeded random token ids (`{"kind": "random_ids"}`, the default
for it; kvlib.models.random_tokens).
"""

from __future__ import annotations

import functools
import random

from kvlib.errors import UserError
from kvlib.models.random_tokens import RANDOM_IDS, NoTextTokenizer, random_token_ids

PYDOC = {"kind": "pydoc"}


@functools.lru_cache(maxsize=4)
def _pydoc_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def dataset_records(source: dict):
    """Records of a `datasets` source, streamed (no full download); one clear error when it cannot be read here."""
    try:
        import datasets
    except ImportError as exc:
        raise UserError("text source needs the `datasets` package: pip install 'kvlib[eval]'") from exc
    kwargs = {k: v for k, v in source.items() if k not in ("kind", "field")}
    try:
        yield from datasets.load_dataset(streaming=True, split=kwargs.pop("split", "train"), **kwargs)
    except (ConnectionError, FileNotFoundError, OSError, ValueError) as exc:
        raise UserError(f"dataset {kwargs.get('path')!r} cannot be read here ({type(exc).__name__}: {exc}). "
                        "It needs Hugging Face hub access (unset HF_DATASETS_OFFLINE) or a local copy.") from exc


def _dataset_texts(source: dict, needed_chars: int) -> str:
    """Concatenate records of a `datasets` source until needed_chars are collected."""
    parts, size = [], 0
    for record in dataset_records(source):
        value = record[source.get("field", "text")]
        text = value if isinstance(value, str) else "\n".join(turn["content"] for turn in value)
        parts.append(text)
        size += len(text)
        if size >= needed_chars:
            break
    return "\n\n".join(parts)


@functools.lru_cache(maxsize=8)
def _corpus_ids(tokenizer, source_key: tuple, min_tokens: int) -> tuple[int, ...]:
    source = dict(source_key)
    if source.get("kind", "pydoc") == "pydoc":
        text = _pydoc_text()
    else:
        text = _dataset_texts(source, needed_chars=min_tokens * 6)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return tuple(ids)


def corpus_ids(tokenizer, min_tokens: int, source: dict | None = None) -> tuple[int, ...]:
    source = source or PYDOC
    # the CPython docs are tokenized whole whatever the length asked, so once a tokenizer (a batch of mixed lengths
    # tokenized them once a prompt: half a batch-16 unit's time); a dataset is read as far as the length needs
    read_to = 0 if source.get("kind", "pydoc") == "pydoc" else min_tokens
    ids = _corpus_ids(tokenizer, tuple(sorted(source.items())), read_to)
    if len(ids) < min_tokens:
        raise UserError(f"text source {source} has {len(ids)} tokens; {min_tokens} are needed")
    return ids


def default_source(tokenizer) -> dict:
    return RANDOM_IDS if isinstance(tokenizer, NoTextTokenizer) else PYDOC


def prompt_of_length(tokenizer, tokens: int, offset: int = 0, source: dict | None = None) -> list[int]:
    """`tokens` consecutive token ids of real text, starting `offset` tokens in (wrapping around the corpus); for
    the random_ids source, as many seeded random ids in the tokenizer's vocabulary."""
    source = source or default_source(tokenizer)
    if source.get("kind") == "random_ids":
        return random_token_ids(len(tokenizer), tokens, offset, seed=source.get("seed", 0))
    ids = corpus_ids(tokenizer, tokens, source)
    start = offset % (len(ids) - tokens + 1)
    return list(ids[start:start + tokens])


def mixed_length_prompts(tokenizer, batch: int, min_tokens: int, max_tokens: int, seed: int = 0,
                         source: dict | None = None) -> list[list[int]]:
    """A batch of prompts whose lengths are drawn uniformly from [min_tokens, max_tokens], each from other text."""
    rng = random.Random(seed)
    lengths = [rng.randint(min_tokens, max_tokens) for _ in range(batch)]
    if batch > 1:  # always span the range, so "mixed" means mixed even for small batches
        lengths[0], lengths[-1] = min_tokens, max_tokens
    return [prompt_of_length(tokenizer, n, offset=rng.randrange(10**9), source=source) for n in lengths]


CALIBRATION_TOKENS = 2048


def calibration_prompt(loaded, source: dict | None = None) -> list[int]:
    """Text for a policy's offline calibration (InfiniGen's skewing takes its first `calibration_tokens`): the start
    of the given source, the CPython docs by default, cut to the model's context."""
    return prompt_of_length(loaded.tokenizer, min(CALIBRATION_TOKENS, loaded.spec.max_context), source=source)
