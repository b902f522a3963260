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
    """Keys kept as heavy hitters [B, H, T, T] from the scaled logits [B, H, T, T] (-inf above the diagonal).

    The harness's top heavy - 1 of the accumulated scores are, from row `heavy` on, the keys the last row kept less
    the one with the lowest score (the others' scores are 0 after eviction, the kept ones' positive): so each row
    evicts one key, and a key is attended from the row it enters (the first `heavy` keys: row 0) until the row that
    evicts it. The loop keeps the scores of the live keys (evicted and later ones +inf, never the minimum) and when
    each key leaves; the mask is built from that at the end (one op a row fewer than writing it row by row)."""
    *lead, t, _ = scores.shape
    if heavy <= 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).reshape(-1, t, t)
    accumulated = probs[:, :heavy, :].sum(dim=-2)
    accumulated[:, heavy:] = float("inf")
    evicted = []
    for row in range(heavy, t):
        lowest = accumulated.argmin(dim=-1, keepdim=True)
        evicted.append(lowest)
        accumulated.scatter_(-1, lowest, float("inf"))
        accumulated[:, row] = 0
        accumulated += probs[:, row, :]
    leaves = torch.full_like(accumulated, t, dtype=torch.long)  # the first row that no longer attends each key
    if evicted:
        rows = torch.arange(heavy, t, device=scores.device).expand(accumulated.shape[0], -1)
        leaves.scatter_(-1, torch.cat(evicted, dim=-1), rows)
    position = torch.arange(t, device=scores.device)
    enters = torch.where(position < heavy, 0, position)
    keep = (position[:, None] >= enters[None, :]) & (position[:, None] < leaves[:, None, :])
    return keep.reshape(*lead, t, t)


def keep_mask(scores: torch.Tensor, heavy: int, recent: int) -> torch.Tensor:
    """What each row attends: its heavy hitters, or a key at most `recent` before it (the causal mask applied by the
    caller)."""
    t = scores.shape[-1]
    band = torch.ones(t, t, dtype=torch.bool, device=scores.device).triu(-recent)
    return heavy_hitter_mask(scores, heavy) | band
