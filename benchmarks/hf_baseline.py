"""transformers' own `generate` on a padded batch, timed step by step: the outside baseline of the benchmarks."""

from __future__ import annotations

import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList


class StepClock(LogitsProcessor):
    """Timestamps every decoding step (the first call comes right after prefill)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


@torch.inference_mode()
def hf_generate(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> dict:
    """Greedy, exactly new_tokens per prompt, left-padded batch, DynamicCache, SDPA."""
    width, pad = max(map(len, prompts)), tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    clock = StepClock()
    start = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, pad_token_id=pad, logits_processor=LogitsProcessorList([clock]))
    end = time.perf_counter()
    return {"decode_tokens_per_s": len(prompts) * (new_tokens - 1) / (end - clock.times[0]),
            "all_first_tokens_s": clock.times[0] - start}


def best_of(runs: list[dict]) -> dict:
    return {"decode_tokens_per_s": max(r["decode_tokens_per_s"] for r in runs),
            "all_first_tokens_s": min(r["all_first_tokens_s"] for r in runs)}
