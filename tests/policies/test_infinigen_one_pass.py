"""InfiniGen's one-pass accuracy mask (kvlib.policies.infinigen_one_pass) against the official rule, restated here from
snu-comparch/InfiniGen@3754f52 accuracy/src/modeling_llama_ours.py (kv_cache_mask, the speculation in forward): the
rows before int(budget x T) dense, then each head its fetch_num best keys, fetch_num = int(mean over heads of the
keys within alpha of the first head's max), capped; a count of 0 attends everything; the first layers dense; the
speculated logits the skewed partial product; and the one pass end to end on SmolLM2-135M."""

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvlib.engine import Engine
from kvlib.errors import UserError
from kvlib.policies import make_policy
from kvlib.policies.infinigen_one_pass import keep_mask, speculated_logits
from kvlib.policies.infinigen_skew import compute_skew


def causal_logits(heads: int, t: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    approx = torch.randn(1, heads, t, t) * 3
    return approx.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))


def official_mask(approx: torch.Tensor, alpha: float, budget: float) -> torch.Tensor:
    """kv_cache_mask restated row by row for one request [1, H, T, T]: True = attended."""
    _, h, t, _ = approx.shape
    a = approx[0]
    fetch_max = int(t * budget)
    threshold = a[0].max(dim=-1).values - alpha  # [T]: head 0's
    counts = (a >= threshold[None, :, None]).sum(dim=-1)  # [H, T]
    keep = torch.ones(h, t, t, dtype=torch.bool)
    for i in range(fetch_max, t):
        n = min(int(float(counts[:, i].float().mean())), fetch_max)
        if n == 0:
            continue  # every key masked alike: the row attends everything
        keep[:, i] = False
        for head in range(h):
            keep[head, i, a[head, i, :i + 1].topk(n).indices] = True
    return keep[None]


@pytest.mark.parametrize("budget", [0.1, 0.3, 0.55])
def test_alpha_inf_keeps_the_cap_on_every_row_past_it(budget):
    t, heads = 24, 3
    approx = causal_logits(heads, t)
    keep = keep_mask(approx, float("inf"), budget) & torch.ones(t, t, dtype=torch.bool).tril()
    cap = int(budget * t)
    assert (keep[:, :, :cap].sum(dim=-1) == torch.arange(1, cap + 1)).all()  # every earlier key
    assert (keep[:, :, cap:].sum(dim=-1) == cap).all()
    for head in range(heads):
        for i in range(cap, t):
            assert set(keep[0, head, i].nonzero().flatten().tolist()) == \
                set(approx[0, head, i].topk(cap).indices.tolist())


def test_the_count_is_the_truncated_mean_over_heads_capped():
    """Row 9 of 10 keys, budget 0.5 (cap 5): head 0 has 3 keys within alpha of its max, head 1 none (all below
    head 0's threshold), so int(1.5) = 1 each; then with head 1 at 8 candidates int(5.5) is capped to 5."""
    t = 10
    approx = torch.full((1, 2, t, t), -50.0).masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    approx[0, 0, 9, [1, 4, 7]] = torch.tensor([10.0, 9.0, 8.5])
    approx[0, 1, 9, :] = torch.arange(t, dtype=torch.float) - 20  # its own best is key 9
    keep = keep_mask(approx, 2.0, 0.5)
    assert keep[0, 0, 9].nonzero().flatten().tolist() == [1]
    assert keep[0, 1, 9].nonzero().flatten().tolist() == [9]
    approx[0, 1, 9, 2:] = 9.0 + torch.arange(8) / 100  # 8 candidates against head 0's threshold of 8
    keep = keep_mask(approx, 2.0, 0.5)
    assert keep[0, :, 9].sum(dim=-1).tolist() == [5, 5]
    assert keep[0, 1, 9].nonzero().flatten().tolist() == [5, 6, 7, 8, 9]


def test_the_threshold_is_the_first_heads_and_a_count_of_zero_attends_everything():
    """Head 0's row is flat far below the others: by each head's own max every head would have candidates, by head
    0's all four heads' keys count; with head 0 far above them, only head 0's one key counts, int(1/4) = 0."""
    t = 8
    approx = causal_logits(4, t)
    approx[0, 0, 7, :] = torch.tensor([100.0] + [-100.0] * 7)
    keep = keep_mask(approx, 1.0, 0.5)
    assert keep[0, :, 7].all()
    approx[0, 0, 7, :] = -100.0
    keep = keep_mask(approx, 1.0, 0.5)
    assert (keep[0, :, 7].sum(dim=-1) == 4).all()  # every head's 8 keys count: capped at int(0.5 x 8)


@pytest.mark.parametrize("alpha, budget", [(float("inf"), 0.3), (2.0, 0.3), (0.5, 0.5), (4.0, 0.05), (1.0, 1.0)])
def test_the_mask_is_the_official_rows(alpha, budget):
    approx = causal_logits(5, 30, seed=3)
    assert torch.equal(keep_mask(approx, alpha, budget) & torch.ones(30, 30, dtype=torch.bool).tril(),
                       official_mask(approx, alpha, budget) & torch.ones(30, 30, dtype=torch.bool).tril())


@pytest.fixture(scope="module")
def bound(tiny):
    policy = make_policy("infinigen", budget=0.3, alpha=float("inf"))
    Engine(tiny, policy, calibration=list(range(3, 200)))
    return policy


def test_dense_layers_attend_everything_and_sparse_need_the_session(bound, tiny):
    key = torch.randn(1, tiny.spec.num_kv_heads, 6, tiny.spec.head_dim)
    assert bound.one_pass_keep(0, None, key, None) is None
    assert bound.one_pass_keep(1, None, key, None) is None
    with pytest.raises(UserError, match="one_pass_session"):
        bound.one_pass_keep(2, None, key, None)


def test_the_speculated_logits_are_the_official_skewed_partial_product(bound, tiny):
    """Layer 2's logits from a layer-1 input: x W_q^T, RoPE, x A, the non-partial columns zeroed, against K A."""
    s, layer, t = tiny.spec, 2, 12
    torch.manual_seed(1)
    hidden = torch.randn(1, t, s.hidden_size)
    key = torch.randn(1, s.num_kv_heads, t, s.head_dim)
    cos, sin = tiny.model.model.rotary_emb(hidden, torch.arange(t)[None])
    got = speculated_logits(bound, layer, hidden, (cos, sin), key)
    skew = compute_skew(tiny, list(range(3, 200))[:bound.calibration_tokens], bound.partial_ratio)
    weight = tiny.model.model.layers[layer].self_attn.q_proj.weight
    q = (hidden @ weight.T).view(1, t, s.num_attention_heads, s.head_dim).transpose(1, 2)
    q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    group = s.num_attention_heads // s.num_kv_heads
    for head in range(s.num_attention_heads):
        a, cols = skew.matrices[layer, head // group], skew.columns[layer, head // group]
        zeroed = torch.zeros(s.head_dim, dtype=torch.bool)
        zeroed[cols[cols >= 0]] = True
        qa = (q[0, head] @ a) * zeroed
        want = qa @ (key[0, head // group] @ a).T / math.sqrt(s.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        assert torch.allclose(got[0, head][causal], want[causal], atol=1e-4)
        assert torch.isinf(got[0, head][~causal]).all()


def dense_loglikelihood(loaded, context: list[int], continuation: list[int]) -> float:
    """The full cache's: one plain causal pass (no policy), the continuation's log-probabilities summed."""
    ids = torch.tensor([(context + continuation)[:-1]])
    with torch.inference_mode():
        logits = loaded.model(input_ids=ids, use_cache=False).logits[0, len(context) - 1:]
    return float(torch.log_softmax(logits.float(), dim=-1).gather(-1, torch.tensor(continuation)[:, None]).sum())


def one_pass_loglikelihood(loaded, context, continuation, **settings) -> tuple[float, float]:
    from kvlib.evaluation.one_pass import Counter, score

    policy = make_policy("infinigen", **settings)
    Engine(loaded, policy, calibration=context)
    counter = Counter()
    ((loglikelihood, _),) = score(loaded, policy, [(context, continuation)], counter)
    assert policy.one_pass_inputs is None  # the session's hooks are gone
    return loglikelihood, counter.share


@pytest.mark.parametrize("model", ["tiny", "smollm"])
def test_one_pass_at_the_whole_budget_is_the_full_cache_and_at_a_tenth_is_not(model, request):
    """SmolLM2-135M (30 layers, 28 of them sparse; the tiny Llama's 4, 2): budget 1.0 with alpha=inf attends
    everything, the full cache's log-likelihood; at budget 0.1 each scored row of a sparse layer attends exactly
    int(0.1 x T) keys per head, and the log-likelihood moves."""
    loaded = request.getfixturevalue(model)
    text = ("The old lighthouse keeper climbed the spiral stairs every evening to light the lamp, and every "
            "morning he wrote in his log what ships had passed in the night. One winter the log ran out of pages,")
    context = loaded.tokenizer(text)["input_ids"]
    continuation = loaded.tokenizer(" so he began a new book")["input_ids"]
    full = dense_loglikelihood(loaded, context, continuation)
    whole, share = one_pass_loglikelihood(loaded, context, continuation, budget=1.0, alpha=float("inf"))
    assert whole == pytest.approx(full, abs=1e-3)
    assert share == pytest.approx(1.0)
    tenth, share = one_pass_loglikelihood(loaded, context, continuation, budget=0.1, alpha=float("inf"))
    assert abs(tenth - full) > 0.05
    t, layers = len(context + continuation) - 1, loaded.spec.num_layers
    visible = sum(range(len(context), t + 1))  # the scored rows' keys, row i seeing i + 1
    cap = int(0.1 * t)
    assert share == pytest.approx((2 * visible + (layers - 2) * cap * len(continuation)) / (layers * visible))
