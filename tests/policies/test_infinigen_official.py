"""InfiniGen against its official code's rules, restated here from snu-comparch/InfiniGen @3754f52 (not by calling
kvlib): the selection of `kv_cache_mask` (accuracy/src/modeling_llama_ours.py) and `speculate_attention`
(speedup/infinigen/infinigen/kv_selection_controller.py) at a decode query, and the skewing matrix and partial columns
of accuracy/setup/gen_llama_skewing_matrix.py and modeling_llama_ours_setup.py. And what measure_coverage reports:
speculation's share of the true attention mass against the oracle's pick of the same count."""

import random

import pytest
import torch
from selection_cases import policy_for, select

from kvlib.engine import Engine
from kvlib.policies import make_policy
from kvlib.policies.infinigen_coverage import coverage
from kvlib.policies.infinigen_skew import capture_qk, compute_skew


def official_selection(approx: torch.Tensor, budget: float, alpha: float) -> tuple[int, list[set[int]]]:
    """approx [H, L]: one row's approximate logits per head at a decode query over its L cached tokens. Each head's
    candidates are the tokens within alpha of its max; the row fetches int(mean over heads of the counts) (the
    speedup code's int(mean); the accuracy code's .to(torch.int32)), at most int(L x budget) (fetch_max), each head
    its top that many."""
    peak = approx.max(dim=-1, keepdim=True).values
    fetch_num = int((approx > peak - alpha).sum(dim=-1).float().mean())
    n = min(fetch_num, int(approx.shape[-1] * budget))
    return n, [set(approx[h].topk(n).indices.tolist()) for h in range(approx.shape[0])]


@pytest.mark.parametrize("kernel", ["c", "torch"])
def test_the_selection_is_the_official_rule(kernel):
    """Multi-head (the official code's attention), distinct scores, alphas and budgets where rounding the mean or
    the cap would pick another count: the same count and the same tokens per head."""
    rng = random.Random(0)
    for i in range(60):
        heads, r, length = rng.choice([2, 3, 5]), rng.choice([3, 12]), rng.randint(8, 300)
        keys = torch.randn(1, heads, r, length + 1)
        query = torch.randn(1, heads, 1, r)
        case = {"query": query, "keys": keys, "rows": torch.tensor([0]), "cached": torch.tensor([length]),
                "budget": rng.choice([0.1, 0.3, 0.5, 0.95]), "alpha": rng.choice([0.5, 2.0, 5.0])}
        approx = torch.einsum("hr,hrl->hl", query[0, :, 0], keys[0, :, :, :length]) * policy_for(case).scale
        n, want = official_selection(approx, case["budget"], case["alpha"])
        table, count = select(case, kernel)
        assert int(count[0]) == max(n, 1), i  # kvlib reads at least one entry (the official code then reads all)
        if n >= 1:
            assert [set(table[0, h, :n].tolist()) for h in range(heads)] == want, i


def official_skew(q: torch.Tensor, k: torch.Tensor, ratio: float) -> tuple[torch.Tensor, list[int]]:
    """A head's skewing matrix and partial columns: A the right singular vectors of its post-RoPE queries (the
    official code permutes A's columns by singular values, which changes no column chosen below), and the union of
    the int(ratio x D) columns with the largest summed |QA| and the int(ratio x D) with the largest summed |KA|."""
    a = torch.linalg.svd(q, full_matrices=True)[2].T
    r = int(ratio * q.shape[-1])
    chosen = set((q @ a).abs().sum(0).topk(r).indices.tolist()) | set((k @ a).abs().sum(0).topk(r).indices.tolist())
    return a, sorted(chosen)


def test_the_skew_and_partial_columns_are_the_official_ones(tiny):
    prompt = list(range(5, 120))
    skew = compute_skew(tiny, prompt, 0.25)
    queries, keys = capture_qk(tiny, prompt)
    group = tiny.spec.num_attention_heads // tiny.spec.num_kv_heads
    for layer in range(tiny.spec.num_layers):
        for h in range(tiny.spec.num_kv_heads):
            q = queries[layer][h * group:(h + 1) * group].float().reshape(-1, tiny.spec.head_dim)
            a, chosen = official_skew(q, keys[layer][h].float(), 0.25)
            kept = [c for c in skew.columns[layer, h].tolist() if c >= 0]
            assert kept == chosen, (layer, h)
            assert torch.allclose(skew.matrices[layer, h][:, kept].abs(), a[:, kept].abs(), atol=1e-5)


def test_the_defaults_are_the_official_llama_runs():
    policy = make_policy("infinigen")
    assert (policy.alpha, policy.partial_ratio, policy.dense_layers, policy.skew_basis) == (5.0, 0.2, 2, "query")


def coverage_run(tiny, **settings) -> dict:
    engine = Engine(tiny, make_policy("infinigen", measure_coverage=True, dense_layers=1, **settings),
                    calibration=list(range(3, 200)))
    prompts = [list(range(10, 90)), list(range(40, 100))]
    return engine.generate(prompts, 6, prefill_mode="fused", stop_at_eos=False).stats


def test_speculation_coverage_is_read_against_the_oracle(tiny):
    """The oracle's pick of the same count carries at least the mass speculation's carries, per layer; fetching
    every entry, both carry all of it."""
    stats = coverage_run(tiny, budget=0.2)
    assert 0 < stats["speculation_coverage"] <= stats["oracle_coverage"] + 1e-6
    assert stats["speculation_recall"] == pytest.approx(stats["speculation_coverage"] / stats["oracle_coverage"])
    for layer, (spec, oracle) in stats["coverage_by_layer"].items():
        assert spec <= oracle + 1e-6, layer
    every = coverage_run(tiny, budget=1.0, alpha=float("inf"))
    assert every["speculation_coverage"] == pytest.approx(1.0, abs=1e-5)
    assert every["oracle_coverage"] == pytest.approx(1.0, abs=1e-5)


def test_the_oracle_takes_the_heaviest_entries_of_the_same_count():
    """One row, one KV head of two queries attending [0.5, 0.1, 0.3] and [0.3, 0.3, 0.3] over the cache and 0.1 each
    on the new token (mean [0.4, 0.2, 0.3], 0.1); speculation picked entry 1 (count 1): its picks carry 0.2 + 0.1, the
    oracle's (entry 0) 0.4 + 0.1."""
    probs = torch.tensor([[[[0.5, 0.1, 0.3, 0.1], [0.3, 0.3, 0.3, 0.1]]]])
    picks, oracle = coverage(probs, torch.tensor([[[1, 3]]]), torch.tensor([1]))
    assert (picks, oracle) == pytest.approx((0.2 + 0.1, 0.4 + 0.1))
