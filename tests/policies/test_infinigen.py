"""InfiniGen: skewed speculation, the full cache in the host tier, per-step fetch of the selected entries."""

import pytest
import torch

from kvlib.engine import Engine
from kvlib.errors import UserError
from kvlib.policies import make_policy
from kvlib.policies.infinigen_skew import capture_qk, compute_skew


@pytest.mark.model
def test_fetching_every_entry_equals_full(smollm, mixed_prompts):
    full = Engine(smollm, make_policy("full")).generate(mixed_prompts, 16)
    # the selected entries read in place (a CPU's default) and copied to the device tier (a GPU's path)
    for mode, fetch in (("full", False), ("fused", False), ("chunked", False), ("fused", True)):
        # budget 1.0 and an alpha that admits every candidate: speculation runs, and each step selects the whole cache
        ig = Engine(smollm, make_policy("infinigen", budget=1.0, alpha=1e9, fetch=fetch)).generate(
            mixed_prompts, 16, prefill_mode=mode, chunk_size=6)
        assert [o["token_ids"] for o in ig.outputs] == [o["token_ids"] for o in full.outputs]
        assert (ig.stats["bytes_moved_host_to_device"] > 0) == fetch and ig.stats["kv_share_attended"] == 1.0


def test_budget_one_is_a_cap_not_a_bypass(tiny):
    """At budget 1.0 InfiniGen still fetches only the candidates speculation finds (the budget caps them)."""
    prompts = [list(range(300, 400))]
    capped = Engine(tiny, make_policy("infinigen", budget=1.0, alpha=0.0)).generate(prompts, 6, stop_at_eos=False)
    dense = 2
    assert all(share < 1.0 for share in capped.stats["kv_share_attended_per_layer"][dense:])


def test_skewing_is_orthogonal_and_leaves_scores_unchanged(tiny):
    prompt = list(range(300, 364))
    skew = compute_skew(tiny, prompt, partial_ratio=0.25)
    queries, keys = capture_qk(tiny, prompt)
    group = tiny.spec.num_attention_heads // tiny.spec.num_kv_heads
    eye = torch.eye(tiny.spec.head_dim)
    for layer in range(tiny.spec.num_layers):
        for h in range(tiny.spec.num_kv_heads):
            a = skew.matrices[layer, h]
            assert torch.allclose(a.T @ a, eye, atol=1e-5)
            q, k = queries[layer][h * group], keys[layer][h]
            assert torch.allclose((q @ a) @ (k @ a).T, q @ k.T, atol=1e-4, rtol=1e-4)
    kept = (skew.columns >= 0).sum(-1)  # the official union: int(0.25 x 16) columns by |QA|, as many by |KA|
    assert ((4 <= kept) & (kept <= 8)).all()
    assert compute_skew(tiny, prompt, partial_ratio=0.25, basis="joint").columns.shape[-1] == 4  # ceil(0.25 x 16)


def test_tiers_and_bytes_moved_match_the_selection(tiny):
    prompts = [list(range(500, 560)), list(range(700, 740))]
    policy = make_policy("infinigen", budget=0.5, alpha=2.0, fetch=True)
    fetched, gathered = [], []
    speculate = policy._speculate_and_fetch

    def recording(layer, step):
        speculate(layer, step)
        _, count, k, _ = policy.fetched[layer + 1]
        fetched.append(int(count.sum()))  # entries per head, summed over rows
        gathered.append(k.shape[0] * k.shape[2])  # what the gather copied: the longest selection, every row

    policy._speculate_and_fetch = recording
    engine = Engine(tiny, policy)
    result = engine.generate(prompts, 5, stop_at_eos=False)
    s = tiny.spec
    entry = s.num_kv_heads * s.head_dim * 2 * 4  # one token's K and V across the heads of one layer, fp32
    assert result.stats["bytes_moved_host_to_device"] == sum(gathered) * entry
    assert sum(gathered) >= sum(fetched)
    sparse = s.num_layers - 2
    assert len(fetched) == 4 * (sparse)  # four decode steps, one fetch per sparse layer
    cached = sum(len(p) + 4 for p in prompts)
    assert result.memory["host"]["kv_bytes"] == cached * sparse * entry
    # at most half of each row's cache is fetched, per layer and step
    assert all(n <= 0.5 * (100 + 8) + 2 for n in fetched)


def test_selection_respects_the_budget_cap(tiny):
    prompt = [list(range(500, 600))]
    result = Engine(tiny, make_policy("infinigen", budget=0.1, alpha=1e9)).generate(prompt, 4, stop_at_eos=False)
    dense = 2
    shares = result.stats["kv_share_attended_per_layer"]
    assert shares[:dense] == [1.0] * dense
    # each sparse layer attends round(0.1 x cached) fetched tokens and the current one
    assert all(share == pytest.approx(0.1, abs=0.02) for share in shares[dense:])


@pytest.mark.parametrize("settings, message", [
    ({"partial_ratio": 0.0}, "partial_ratio"),
    ({"partial_ratio": 1.2}, "partial_ratio"),
    ({"budget": 0.0}, "budget must be in"),
    ({"alpha": -1.0}, "alpha must be"),
    ({"dense_layers": 0}, "dense_layers must be >= 1"),
])
def test_bad_settings(settings, message):
    with pytest.raises(UserError, match=message):
        make_policy("infinigen", **settings)


def test_unsupported_attention_is_refused(tiny):
    class NoQProj(torch.nn.Module):
        pass

    saved = tiny.model.model.layers[0].self_attn
    tiny.model.model.layers[0].self_attn = NoQProj()
    try:
        with pytest.raises(UserError, match="self_attn.q_proj"):
            Engine(tiny, make_policy("infinigen"))
    finally:
        tiny.model.model.layers[0].self_attn = saved


@pytest.mark.parametrize("dense_layers", [1, 3])
def test_any_number_of_dense_layers_fetching_everything_equals_full(tiny, dense_layers):
    prompts = [list(range(300, 340)), list(range(600, 625))]
    full = Engine(tiny, make_policy("full")).generate(prompts, 6, stop_at_eos=False)
    ig = Engine(tiny, make_policy("infinigen", budget=1.0, alpha=1e9, dense_layers=dense_layers)).generate(
        prompts, 6, stop_at_eos=False)
    assert [o["token_ids"] for o in ig.outputs] == [o["token_ids"] for o in full.outputs]
