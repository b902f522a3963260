"""H2O's accuracy rule as its lm-eval harness applies it (FMInference/H2O h2o_hf/utils_lm_eval/modify_llama.py,
`local_heavy_hitter_mask`, at 1603343): one pass over context and continuation, each query row masked.

Per attention head, over a sequence of T tokens: `heavy` = int(heavy_ratio x T), `recent` = int(recent_ratio x T).
The first `heavy` rows attend every earlier key. From row `heavy` on, a row attends the heavy - 1 keys with the
highest accumulated attention, itself, and the `recent` keys before it; then its own attention (the unmasked
probabilities) is added to the scores and every key it did not keep loses its score for good (multiplied by 0):
eviction, simulated row by row, each row seeing only what earlier rows chose. (An earlier version of the harness
chose the heavy hitters once from column sums over all rows, later ones included; the commit named above does not.)
"""

from __future__ import annotations

import torch


def heavy_hitter_mask(scores: torch.Tensor, heavy: int) -> torch.Tensor:
    """Keys kept as heavy hitters [B, H, T, T] from the scaled logits [B, H, T, T] (-inf above the diagonal)."""
    t = scores.shape[-1]
    keep = torch.zeros_like(scores, dtype=torch.bool)
    if heavy <= 0:
        return keep
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    accumulated = probs[..., :heavy, :].sum(dim=-2)
    accumulated[..., heavy:] = 0
    keep[..., :heavy, :heavy] = True
    for row in range(heavy, t):
        chosen = torch.zeros_like(accumulated, dtype=torch.bool)
        chosen.scatter_(-1, accumulated.topk(heavy - 1, dim=-1).indices, True)
        chosen[..., row] = True
        keep[..., row, :] = chosen
        accumulated = (accumulated + probs[..., row, :]) * chosen
    return keep


def keep_mask(scores: torch.Tensor, heavy: int, recent: int) -> torch.Tensor:
    """What each row attends: its heavy hitters, or a key at most `recent` before it (the causal mask applied by the
    caller)."""
    t = scores.shape[-1]
    band = torch.ones(t, t, dtype=torch.bool, device=scores.device).triu(-recent)
    return heavy_hitter_mask(scores, heavy) | band
