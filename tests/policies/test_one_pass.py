"""The official accuracy harnesses' protocol (kvlib.evaluation.one_pass): one masked pass per scored request, H2O's
mask as its lm-eval harness builds it."""

import math

import pytest
import torch

from kvlib.engine import Engine
from kvlib.errors import UserError
from kvlib.evaluation import KVLibLM, one_pass
from kvlib.policies import make_policy
from kvlib.policies.h2o_one_pass import heavy_hitter_mask, keep_mask

CONTEXT, CONTINUATION = list(range(300, 380)), list(range(500, 512))


def harness_mask(scores: torch.Tensor, heavy: int, recent: int) -> torch.Tensor:
    """The harness's rule written out key by key, one head at a time, as its loop reads (the reference)."""
    heads, t = scores.shape[1], scores.shape[-1]
    probs = torch.softmax(scores, dim=-1)
    out = torch.zeros(1, heads, t, t, dtype=torch.bool)
    for h in range(heads):
        score = [float(probs[0, h, :heavy, j].sum()) if j < heavy else 0.0 for j in range(t)]
        for i in range(t):
            if heavy == 0:  # (the harness's guard: no heavy hitters at all)
                kept = set()
            elif i < heavy:
                kept = set(range(heavy))
            else:
                order = sorted(range(t), key=lambda j: -score[j])[:heavy - 1]
                kept = set(order) | {i}
                score = [(score[j] + float(probs[0, h, i, j])) * (j in kept) for j in range(t)]
            for j in range(i + 1):
                out[0, h, i, j] = j in kept or j >= i - recent
    return out


def causal_scores(t: int, heads: int = 3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(1, heads, t, t, generator=g) * 3
    return scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))


@pytest.mark.parametrize("heavy,recent", [(4, 4), (6, 2), (1, 3), (0, 5)])
def test_h2o_mask_is_the_harness_rule(heavy, recent):
    scores = causal_scores(24)
    ours = keep_mask(scores, heavy, recent) & torch.ones(24, 24, dtype=torch.bool).tril()
    assert torch.equal(ours, harness_mask(scores, heavy, recent))


def test_a_row_past_the_heavy_rows_keeps_heavy_minus_one_hitters_itself_and_its_window():
    scores = causal_scores(40)
    heavy = heavy_hitter_mask(scores, 8)
    assert heavy[..., :8, :8].all() and not heavy[..., :8, 8:].any()
    past = heavy[..., 8:, :]
    assert (past.sum(-1) <= 8).all()  # heavy - 1 hitters and the row itself (a hitter may be itself)
    assert past[..., torch.arange(32), torch.arange(8, 40)].all()


def test_evicted_keys_never_come_back():
    heavy = heavy_hitter_mask(causal_scores(40), 6)
    for i in range(7, 40):
        lost = ~heavy[..., i - 1, :i - 1]  # before row i - 1, what it did not keep
        assert not (heavy[..., i, :i - 1] & lost).any(), i


@pytest.fixture(scope="module")
def scored(smollm):
    def score(policy, **settings):
        kv_policy = make_policy(policy, **settings)
        Engine(smollm, kv_policy)
        counter = one_pass.Counter()
        [(logprob, _)] = one_pass.score(smollm, kv_policy, [(CONTEXT, CONTINUATION)], counter)
        return logprob, counter.share
    return score


def test_full_is_lm_evals_dense_pass(smollm, scored):
    with torch.inference_mode():
        logits = smollm.model(input_ids=torch.tensor([CONTEXT + CONTINUATION[:-1]]), use_cache=False).logits[0]
    logprobs = torch.log_softmax(logits[len(CONTEXT) - 1:], dim=-1)
    dense = float(logprobs.gather(-1, torch.tensor(CONTINUATION)[:, None]).sum())
    logprob, share = scored("full")
    assert logprob == pytest.approx(dense, rel=1e-5)
    assert share == 1.0


def test_h2o_at_the_whole_sequence_is_full_and_a_small_budget_is_not(scored):
    full, _ = scored("full")
    whole, share = scored("h2o", budget=1.0, budget_rule="flexgen")
    assert whole == pytest.approx(full, rel=1e-5) and share == 1.0
    small, share = scored("h2o", budget=0.1, budget_rule="flexgen")
    assert not math.isclose(small, full, rel_tol=1e-3)
    assert 0.1 < share < 0.5  # heavy + recent ~ 2 x 0.1 of 91 tokens, of what each scored row could see


def test_the_flexgen_rule_keeps_about_twice_the_seen_rules_share(scored):
    _, flexgen = scored("h2o", budget=0.1, budget_rule="flexgen")
    _, seen = scored("h2o", budget=0.1, budget_rule="seen")
    assert flexgen == pytest.approx(2 * seen, rel=0.25)


def test_requests_fed_the_same_tokens_share_one_pass_and_score_as_each_alone(smollm):
    policy = make_policy("h2o", budget=0.2, budget_rule="flexgen")
    Engine(smollm, policy)
    # two one-token choices of one context (fed the same tokens), a longer request, the first choice again
    requests = [(CONTEXT, [500]), (CONTEXT, [501]), (CONTEXT[:60], CONTINUATION), (CONTEXT, [500])]
    alone, alone_counter = [], one_pass.Counter()
    for request in requests:
        alone += one_pass.score(smollm, policy, [request], alone_counter)
    passes, counter = [], one_pass.Counter()
    hook = smollm.model.register_forward_pre_hook(lambda *_: passes.append(1))
    try:
        shared = one_pass.score(smollm, policy, requests, counter)
    finally:
        hook.remove()
    assert len(passes) == 2
    assert shared == alone and shared[0] != shared[1]
    assert (counter.attended, counter.visible) == (alone_counter.attended, alone_counter.visible)


def test_a_policy_without_an_official_rule_is_refused_before_the_model_loads():
    with pytest.raises(UserError, match="no official one-pass accuracy rule.*one_pass runs .*h2o"):
        KVLibLM(pretrained="no-such-model", policy="streaming", protocol="one_pass")


def test_generated_answers_are_refused_under_one_pass(smollm):
    lm = KVLibLM(policy="full", loaded=smollm, protocol="one_pass")
    with pytest.raises(UserError, match="scores log-likelihood tasks"):
        lm.generate_until([])
