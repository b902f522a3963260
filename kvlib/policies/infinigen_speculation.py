"""InfiniGen's speculation (kvlib.policies.infinigen): which cached entries each (row, KV head) of a sparse layer reads
at a decode step, and what choosing them costs.

The next layer's query, skewed and cut to the partial columns, against every cached token's partial key gives an
approximate logit (the largest over the KV head's query group). Tokens within `alpha` of the head's best are
candidates; a row fetches the mean over its heads of its candidates' count, truncated, at most its cap
(`fetch_cap`, int(budget x cached tokens)) and at least one: each head its best-scored ones. So alpha,
not the budget, decides what a row fetches wherever the candidates are fewer than the cap; `alpha=inf` makes the cap
bind (every head fetches it), as the official code's figure-13 runs do with alpha 99.
"""

from __future__ import annotations

import torch

from kvlib.kernels import cpu_kernel
from kvlib.kernels.decode import rows_view


def fetch_cap(budget: float, budget_tokens: int | None, cached: int) -> int:
    """The most a head fetches from a row of `cached` tokens: int(budget x cached) as the official code's fetch_max
    (truncated, where the other sparse policies' tokens_allowed rounds), at least one; or budget_tokens."""
    if budget_tokens is not None:
        return min(budget_tokens, cached)
    return min(cached, max(1, int(budget * cached)))


def select(q_part: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, cached: torch.Tensor, cap: torch.Tensor,
           scale: float, alpha: float, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """What each (row, KV head) reads this step: (index list [B, Hkv, W] on the CPU, its picks first, then the row's
    new token at position cached; picks a head [B]). q_part [B, Hkv, G, r]: the skewed partial queries; keys: the
    layer's partial keys [rows, Hkv, r, tokens]; cached [B]: the tokens already in each row's cache; cap [B]. On kvlib's
    C kernels one call (kvlib.kernels.cpu_kernel.infinigen_select); elsewhere the PyTorch ops below, which choose the
    same."""
    if kernel == "c":
        # alpha=inf (every token a candidate) as a finite float: the C kernel takes fp32 numbers
        return cpu_kernel.infinigen_select(q_part, keys, rows, cached, cap, scale, min(alpha, 1e30),
                                           int(cap.max()) + 1)
    k_part = rows_view(keys, rows)[..., :int(cached.max())]  # [B, Hkv, r, L]
    approx = torch.matmul(q_part, k_part).amax(dim=2) * scale  # [B, Hkv, L]
    if int(cached.min()) < approx.shape[-1]:  # rows shorter than the longest: their tail is no candidate
        valid = (torch.arange(approx.shape[-1])[None, :] < cached[:, None]).to(approx.device)
        approx = approx.masked_fill(~valid[:, None, :], float("-inf"))
    peak = approx.amax(dim=-1, keepdim=True)
    candidates = (approx > peak - alpha).sum(dim=-1).sum(dim=-1).cpu() // approx.shape[1]  # [B]: int(mean)
    count = torch.minimum(candidates, cap).clamp(min=1)
    # best first, equal scores the earlier token first: the C selection's order
    chosen = approx.sort(dim=-1, descending=True, stable=True).indices[..., :int(count.max())].cpu()
    table = torch.cat([chosen, cached[:, None, None].expand(-1, chosen.shape[1], 1)], dim=-1)
    table[torch.arange(len(rows)), :, count] = cached[:, None]
    return table, count


def work(spec, r: int, rows: int, tokens: int) -> dict:
    """Speculation's work at one sparse layer (kvlib.memory.work): the next layer's query projected and skewed, its r
    columns against every cached token's partial key (`tokens` over the rows, read from the device tier), for each
    query head."""
    q_width = spec.num_attention_heads * spec.head_dim
    return {"select_read_bytes": tokens * spec.num_kv_heads * r * spec.dtype_bytes,
            "select_flops": 2 * rows * (spec.hidden_size * q_width + q_width * r)
            + 2 * tokens * spec.num_attention_heads * r}
