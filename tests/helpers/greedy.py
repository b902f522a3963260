"""Greedy decoding through kvlib's engine with every step's logits, as the forward-pass tests of each architecture
compare them."""

import torch

from kvlib.engine import Engine
from kvlib.policies import make_policy


def decode(loaded, prompts, steps, policy="full"):
    """Greedy tokens and every step's logits."""
    kv = make_policy(policy)
    with Engine(loaded, kv).session([len(p) for p in prompts], steps) as s:
        logits = [torch.stack([s.prefill(r, p, "fused") for r, p in enumerate(prompts)])]
        tokens = [logits[-1].argmax(-1).tolist()]
        for _ in range(steps - 1):
            logits.append(s.decode(list(range(len(prompts))), tokens[-1]))
            tokens.append(logits[-1].argmax(-1).tolist())
    return tokens, torch.stack(logits)
