"""Ada-KV's and PyramidKV's own rules (issue 53, items 10 and 11), each checked against a re-statement of the official
code written here from its source (FFY0/AdaKV @ efe4e2e `adaptive_snapkv/monkeypatch/snapkv_utils.py`,
Zefan-Cai/KVCache-Factory @ c97f9d7 `pyramidkv/pyramidkv_utils.py` and `run_longbench.py`, FasterDecoding/SnapKV
@ e216ddc `snapkv/monkeypatch/snapkv_utils.py`), never by calling kvlib for the expected values."""

import math

import pytest
import torch
import torch.nn.functional as F

from kvlib.engine import Engine
from kvlib.errors import UserError
from kvlib.policies import REGISTRY, make_policy
from kvlib.policies.allocation import adaptive_counts, pyramid_counts


# -- the official rules, re-stated ---------------------------------------------------------------------------------
def ffy0_counts(scores: torch.Tensor, base: int, floor_alpha: float) -> list[list[int]]:
    """AdaptiveSnapKVCluster.update_kv, per layer (bsz 1): each head's scores sorted, the layer's H x base best of
    them flattened, each head's count c among them, then round(c x (1 - floor_alpha) + int(base x floor_alpha))."""
    out = []
    for layer in scores:  # [H, n]
        heads, length = layer.shape
        ordered = layer.sort(dim=-1, descending=True).values.reshape(1, heads * length)
        top = torch.topk(ordered, k=heads * base, dim=-1).indices // length
        count = torch.zeros((1, heads), dtype=top.dtype)
        count.scatter_add_(-1, top, torch.ones_like(top))
        out.append(torch.round(count * (1 - floor_alpha) + int(base * floor_alpha)).int()[0].tolist())
    return out


def kvpress_shape_counts(scores: torch.Tensor, base: int, alpha: float) -> list[list[int]]:
    """kvlib's older rule (AdaKVPress's shape): each head's own int(alpha x base) best first, then the layer's best
    (head, token) pairs left, up to H x base; loops, for a few small tensors."""
    out = []
    for layer in scores.tolist():
        floor = int(alpha * base)
        taken = [set(sorted(range(len(h)), key=lambda t: -h[t])[:floor]) for h in layer]
        left = sorted(((s, h, t) for h, row in enumerate(layer) for t, s in enumerate(row) if t not in taken[h]),
                      reverse=True)
        counts = [floor] * len(layer)
        for _, h, _ in left[:len(layer) * (base - floor)]:
            counts[h] += 1
        out.append(counts)
    return out


def pyramidkv_capacities(layers: int, max_capacity_prompt: int, window: int, q_len: int, beta: int = 20) -> list[int]:
    """PyramidKVCluster.update_kv, layer by layer: the older tokens each keeps beside the window."""
    out = []
    for layer_idx in range(layers):
        min_num = (max_capacity_prompt - window) // beta
        max_num = (max_capacity_prompt - window) * 2 - min_num
        if max_num >= q_len - window:
            max_num = q_len - window
            min_num = (max_capacity_prompt - window) * 2 - max_num
        steps = (max_num - min_num) // (layers - 1)
        capacity = max_num - layer_idx * steps
        if q_len < max_capacity_prompt:
            out.append(q_len - window)  # kept whole
        elif q_len < (max_capacity_prompt - window) * 2:
            out.append(max_capacity_prompt - window)
        else:
            out.append(capacity)
    return out


# -- Ada-KV ---------------------------------------------------------------------------------------------------------
def test_adakv_gives_ffy0s_counts_where_kvpresss_shape_gives_others():
    scores = torch.tensor([[[9., 8., 7., 1.], [6., 0., 0., 0.]]])  # the layer's top 4: three of head 0, one of head 1
    assert ffy0_counts(scores, 2, 0.5) == [[2, 2]]  # round(3 x 0.5 + 1) = round(2.5) = 2, round(1.5) = 2
    assert kvpress_shape_counts(scores, 2, 0.5) == [[3, 1]]
    assert make_policy("adakv", floor_alpha=0.5).heavy_counts(scores, 2).tolist() == [[2, 2]]
    assert make_policy("adakv", floor_alpha=0.5, formula="kvpress").heavy_counts(scores, 2).tolist() == [[3, 1]]


@pytest.mark.parametrize("seed, base, alpha", [(0, 5, 0.2), (1, 12, 0.2), (2, 3, 0.5), (3, 20, 0.0), (4, 7, 0.2)])
def test_adakv_counts_are_ffy0s_on_fixed_score_tensors(seed, base, alpha):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(3, 4, 24, generator=g) ** 4
    scores[:, 2] *= 6  # one head concentrated above the others
    policy = make_policy("adakv", floor_alpha=alpha)
    assert policy.heavy_counts(scores, base).tolist() == ffy0_counts(scores, base, alpha)
    assert adaptive_counts(scores, base, alpha, "kvpress").tolist() == kvpress_shape_counts(scores, base, alpha)


def test_ffy0s_rounding_need_not_keep_the_uniform_total():
    """The counts are rounded one by one: a layer may hold fewer than H x base entries (kvpress's shape never does)."""
    scores = torch.tensor([[[9., 8., 7., 1., 0.], [6., 0., 0., 0., 0.]]])  # the top 4: three of head 0, one of head 1
    assert ffy0_counts(scores, 2, 0.2) == [[2, 1]]  # round(2.4) + round(0.8): 3 of 4
    assert make_policy("adakv").heavy_counts(scores, 2).tolist() == [[2, 1]]


def test_a_budget_covering_the_prompt_keeps_it_whole_under_adakv():
    """kvlib's one departure from FFY0's formula: at base = n it compresses, and round(3 x 0.8 + 0) drops an entry."""
    scores = torch.rand(2, 3, 3)
    assert ffy0_counts(scores, 3, 0.2) == [[2, 2, 2]] * 2
    assert make_policy("adakv").heavy_counts(scores, 3).tolist() == [[3, 3, 3]] * 2


def test_adakv_compacts_each_head_to_ffy0s_count_of_its_own_votes(tiny):
    """End to end on the tiny model: the counts FFY0's rule gives on the votes the policy cast are what each head keeps,
    beside the window."""
    torch.manual_seed(3)
    prompt = torch.randint(100, 5000, (120,)).tolist()
    policy = make_policy("adakv", budget=0.5, window=8)
    seen = []
    counts = policy.heavy_counts
    policy.heavy_counts = lambda scores, heavy: (seen.append((scores.clone(), heavy)), counts(scores, heavy))[1]
    with Engine(tiny, policy).session([120], 2) as session:
        session.prefill(0, prompt, "chunked", chunk_size=32)
        (scores, heavy), = seen
        assert heavy == 60 - 8
        want = ffy0_counts(scores, heavy, 0.2)
        got = [[len(h) - 8 for h in policy.kept_positions(layer, 0)] for layer in range(tiny.spec.num_layers)]
    assert got == want


# -- PyramidKV ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layers, capacity, window, q_len", [
    (4, 40, 8, 200),  # uncapped
    (30, 51, 8, 512),  # SmolLM2's layers at budget 0.1 of 512 tokens, uncapped
    (4, 40, 8, 70),  # capped: 2 x 32 - 1 >= the 62 older tokens
    (30, 100, 8, 186),  # capped, SmolLM2's layers
    (4, 40, 8, 60),  # under 2 x 32: uniform
    (4, 40, 8, 40),  # the budget is the prompt: whole
])
def test_pyramidkv_layer_counts_are_kvcache_factorys(layers, capacity, window, q_len):
    want = pyramidkv_capacities(layers, capacity, window, q_len)
    policy = make_policy("pyramidkv", budget_tokens=capacity, window=window)
    scores = torch.rand(layers, 3, q_len - window)
    counts = policy.heavy_counts(scores, capacity - window)
    assert counts.tolist() == [[c] * 3 for c in want]


def test_pyramidkv_keeps_more_than_the_uniform_total_where_its_step_rounds_down():
    want = pyramidkv_capacities(30, 51, 8, 512)
    assert want[0] == 2 * 43 - 43 // 20 and sum(want) > 30 * 43  # step (84 - 2) // 29 = 2: 84 down to 26
    kvlib_line = pyramid_counts(30, 1, 43, 504, 20.0, schedule="kvlib")[:, 0]
    assert int(kvlib_line.sum()) == 30 * 43  # the older schedule, a named setting: exactly SnapKV's total


@pytest.mark.parametrize("q_len, capacity", [(120, 40), (70, 40), (60, 40)])
def test_pyramidkv_compacts_each_layer_to_kvcache_factorys_count(tiny, q_len, capacity):
    torch.manual_seed(q_len)
    prompt = torch.randint(100, 5000, (q_len,)).tolist()
    policy = make_policy("pyramidkv", budget_tokens=capacity)
    with Engine(tiny, policy).session([q_len], 2) as session:
        session.prefill(0, prompt, "chunked", chunk_size=32)
        got = [len(policy.kept_positions(layer, 0)[0]) for layer in range(tiny.spec.num_layers)]
    assert got == [c + 8 for c in pyramidkv_capacities(tiny.spec.num_layers, capacity, 8, q_len)]


# -- the scorers' settings ------------------------------------------------------------------------------------------
OFFICIAL_SCORERS = {  # name: (window, kernel, pooling), as the official runs set them
    "snapkv": (32, 5, "avgpool"),  # init_snapkv's defaults
    "adakv": (32, 7, "maxpool"),  # AdaptiveSnapKVCluster / config_compress defaults, GQA_eval_longbench.sh's configs
    "pyramidkv": (8, 7, "maxpool"),  # run_longbench.py, for every method it runs
}


@pytest.mark.parametrize("name", sorted(OFFICIAL_SCORERS))
def test_the_scorers_defaults_are_the_official_runs(name):
    policy = make_policy(name)
    assert (policy.window, policy.kernel_size, policy.pooling) == OFFICIAL_SCORERS[name]


def test_the_allocations_defaults_are_the_official_ones():
    adakv, pyramidkv = make_policy("adakv"), make_policy("pyramidkv")
    assert (adakv.allocation, adakv.formula, adakv.floor_alpha) == ("adaptive", "adakv", 0.2)  # pred.py's floor_alpha
    assert (pyramidkv.allocation, pyramidkv.schedule, pyramidkv.pyramid_beta) == ("pyramid", "pyramidkv", 20)


def test_votes_are_the_groups_mean_then_pooled(tiny):
    """FFY0's gqa_support (gqa_func mean) and KVCache-Factory's kv_head layout: the window's attention summed over its
    queries, averaged over a KV head's query heads, then max-pooled (the order matters under maxpool)."""
    policy = make_policy("adakv", pooling="maxpool", kernel_size=3)
    Engine(tiny, policy)
    spec = policy.spec
    g = torch.Generator().manual_seed(5)
    w, end = 4, 15
    window_q = torch.randn(spec.num_attention_heads, w, spec.head_dim, generator=g)
    keys = torch.randn(spec.num_kv_heads, end, spec.head_dim, generator=g)
    scores = torch.zeros(spec.num_kv_heads, end)
    policy._vote(0, window_q, keys, scores)
    group = spec.num_attention_heads // spec.num_kv_heads
    k = keys.repeat_interleave(group, dim=0)  # repeat_kv
    logits = window_q @ k.transpose(1, 2) / math.sqrt(spec.head_dim)
    logits[:, :, -w:] += torch.full((w, w), float("-inf")).triu(1)
    probs = torch.softmax(logits, dim=-1)[:, :, :end - w].sum(dim=1)  # [Hq, prefix]
    want = F.max_pool1d(probs.view(spec.num_kv_heads, group, -1).mean(dim=1)[:, None], 3, 1, 1)[:, 0]
    assert torch.allclose(scores[:, :end - w], want, atol=1e-6)


# -- the fidelity entries -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["snapkv", "adakv", "pyramidkv"])
def test_each_hybrid_declares_its_rules_and_they_are_consistent(name):
    from kvlib.policies import fidelity as fid  # (here: the module is new with issue 53)

    cls = REGISTRY[name]
    assert "fidelity" in cls.__dict__
    table = fid.rows({name: cls})
    rules = {r["rule"] for r in table}
    assert {"observation window", "pooling kernel", "pooling", "budget"} <= rules
    assert all(r["verdict"] == "same" for r in table if r["rule"] in ("observation window", "pooling kernel",
                                                                        "pooling"))


@pytest.mark.parametrize("name, settings, message", [
    ("adakv", {"formula": "ffy0"}, "formula"), ("pyramidkv", {"schedule": "linear"}, "schedule")])
def test_bad_rule_settings_are_one_clear_error(name, settings, message):
    with pytest.raises(UserError, match=message):
        make_policy(name, **settings)
