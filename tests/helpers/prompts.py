"""Prompts of random token ids at given lengths, the same for a seed: what the engine and policy tests feed."""

import torch


def prompts_of(*lengths: int, seed: int = 0) -> list[list[int]]:
    torch.manual_seed(seed)
    return [torch.randint(100, 5000, (n,)).tolist() for n in lengths]
