"""How good InfiniGen's speculation was (`measure_coverage`): at a sparse layer's decode step, the share of its true
attention mass the speculated picks carry, against the share the best picks of the same count (the oracle's) would
carry. Their ratio is speculation's recall: 1 where speculation picks what the true attention would."""

from __future__ import annotations

import torch


def coverage(probs: torch.Tensor, chosen: torch.Tensor, count: torch.Tensor) -> tuple[float, float]:
    """probs [B, Hkv, G, L + 1]: a layer's true attention over a step's cache, the new token last; chosen [B, Hkv, W]
    the picks (a row's first count[b] of them), the new token always attended. Returns (the picks' mass, the oracle's),
    each averaged over rows, KV heads and their query groups."""
    mass = probs.mean(dim=2)  # [B, Hkv, L + 1]: a KV head's entries serve its group's queries alike
    length = mass.shape[-1] - 1
    keep = torch.arange(chosen.shape[-1], device=chosen.device)[None, None, :] < count.to(chosen.device)[:, None, None]
    picked = torch.zeros_like(mass, dtype=torch.bool)
    picked.scatter_(-1, chosen.masked_fill(~keep, length), True)
    picked[..., -1] = True
    ranked = mass[..., :-1].sort(dim=-1, descending=True).values.cumsum(dim=-1)
    best = ranked.gather(-1, (count.to(mass.device) - 1)[:, None, None].expand(-1, mass.shape[1], 1))[..., 0]
    return float((mass * picked).sum(-1).mean()), float((best + mass[..., -1]).mean())


def means(samples: int, mass: float, oracle: float) -> dict:
    """From the sums over `samples` (layer, step) pairs: the mean mass the picks carried, the oracle's, and the picks'
    recall of the oracle's mass (what a run reports, and what KVLibLM reports over its runs)."""
    return {"speculation_coverage": mass / samples, "oracle_coverage": oracle / samples,
            "speculation_recall": mass / oracle}


def summary(samples: list[tuple[int, float, float]]) -> dict:
    """(layer, picks' mass, oracle's mass) per sparse layer and step -> the run's means, their ratio, per layer, and
    the sums a caller adds up over runs (kvlib.evaluation.lm)."""
    if not samples:
        return {"speculation_coverage": None}
    mean = lambda xs: sum(xs) / len(xs)
    picks, oracle = [c for _, c, _ in samples], [o for _, _, o in samples]
    layers = sorted({layer for layer, _, _ in samples})
    return {"speculation_samples": len(samples), "speculation_mass_sum": sum(picks), "oracle_mass_sum": sum(oracle),
            **means(len(samples), sum(picks), sum(oracle)),
            "coverage_by_layer": {layer: (mean([c for at, c, _ in samples if at == layer]),
                                          mean([o for at, _, o in samples if at == layer])) for layer in layers}}


def true_attention(query: torch.Tensor, keys: torch.Tensor, cached: torch.Tensor, scale: float) -> torch.Tensor:
    """probs [B, Hkv, G, L + 1]: a decode step's queries [B, Hq, D] over keys [B, Hkv, L + 1, D] (the cache, then the
    new token), row b seeing its first cached[b] entries and the new one."""
    rows, kv_heads, length, head_dim = keys.shape
    logits = torch.einsum("bhgd,bhld->bhgl", query.view(rows, kv_heads, -1, head_dim), keys)
    valid = (torch.arange(length)[None, :] < cached[:, None]).to(keys.device)
    valid[:, -1] = True
    return torch.softmax((logits * scale).masked_fill(~valid[:, None, None, :], float("-inf")), dim=-1)
