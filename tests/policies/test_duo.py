"""DuoAttention (kvlib.policies.duo): retrieval heads keep every entry, streaming heads keep sinks and a window."""

import pytest
import torch
from prompts import prompts_of as random_prompts

from kvlib.engine import Engine
from kvlib.errors import UserError
from kvlib.models.workloads import calibration_prompt
from kvlib.policies import duo_heads, make_policy


def prompts_of(*lengths, seed=1):  # this file's prompts are seed 1's
    return random_prompts(*lengths, seed=seed)

def tokens(result):
    return [o["token_ids"] for o in result.outputs]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Head scores are cached per model: each test computes its own."""
    monkeypatch.setenv("KVLIB_CACHE", str(tmp_path))


@pytest.mark.parametrize("mode", ["chunked", "fused"])
def test_at_budget_one_every_head_is_a_retrieval_head_and_the_tokens_are_fulls(tiny, kernel, mode):
    prompts = prompts_of(70, 120, 40)
    full = Engine(tiny, make_policy("full")).generate(prompts, 10, prefill_mode=mode, chunk_size=32,
                                                      stop_at_eos=False)
    policy = make_policy("duo", budget=1.0, sink=4, window=16)
    duo = Engine(tiny, policy).generate(prompts, 10, prefill_mode=mode, chunk_size=32, stop_at_eos=False)
    assert duo.stats["retrieval_heads"] == duo.stats["heads"] == tiny.spec.num_layers * tiny.spec.num_kv_heads
    assert tokens(duo) == tokens(full)


@pytest.mark.parametrize("mode", ["chunked", "fused"])
def test_at_ratio_zero_every_head_streams_and_the_tokens_are_streamingllms(tiny, kernel, mode):
    prompts = prompts_of(70, 120, 40)
    streaming = Engine(tiny, make_policy("streaming", budget_tokens=20, sink=4)).generate(
        prompts, 10, prefill_mode=mode, chunk_size=32, stop_at_eos=False)
    duo = Engine(tiny, make_policy("duo", retrieval_ratio=0.0, sink=4, window=16)).generate(
        prompts, 10, prefill_mode=mode, chunk_size=32, stop_at_eos=False)
    assert duo.stats["retrieval_heads"] == 0
    assert tokens(duo) == tokens(streaming)


def test_a_conversations_next_turn_at_ratio_zero_is_streamingllms(tiny):
    """A later turn's prompt attends what the streaming heads kept of the earlier ones, as StreamingLLM's does."""
    first, second = prompts_of(60, 30)
    outputs = {}
    for name, settings in (("streaming", {"budget_tokens": 20, "sink": 4}),
                           ("duo", {"retrieval_ratio": 0.0, "sink": 4, "window": 16})):
        engine = Engine(tiny, make_policy(name, **settings))
        with engine.session([60 + 5 + 30], 10) as session:
            got = [int(session.prefill(0, first, "chunked", chunk_size=16).argmax())]
            for _ in range(4):
                got.append(int(session.decode([0], [got[-1]])[0].argmax()))
            got.append(int(session.prefill(0, second, "chunked", chunk_size=16).argmax()))
            for _ in range(4):
                got.append(int(session.decode([0], [got[-1]])[0].argmax()))
        outputs[name] = got
    assert outputs["duo"] == outputs["streaming"]


def test_streaming_heads_hold_sinks_and_window_only(tiny):
    """At ratio 0.5 half the heads hold sink + window + 1 entries a row, however long the row: the ledger's KV is
    what the retrieval heads hold in full plus the rings."""
    prompt, new = prompts_of(100)[0], 6
    policy = make_policy("duo", retrieval_ratio=0.5, sink=4, window=16)
    result = Engine(tiny, policy).generate([prompt], new, prefill_mode="chunked", chunk_size=32, stop_at_eos=False)
    s = tiny.spec
    heads = s.num_layers * s.num_kv_heads
    assert result.stats["retrieval_heads"] == heads // 2
    seen = len(prompt) + new - 1  # the last token is never fed back
    head_token = 2 * s.head_dim * s.dtype_bytes
    assert result.memory["device"]["kv_bytes"] == (heads // 2) * (seen + 21) * head_token
    full = Engine(tiny, make_policy("full")).generate([prompt], new, prefill_mode="chunked", chunk_size=32,
                                                      stop_at_eos=False)
    assert result.memory["device"]["kv_bytes"] < 0.65 * full.memory["device"]["kv_bytes"]
    assert 0.5 < result.stats["kv_share_attended"] < 0.7


def test_retrieval_heads_are_the_highest_scored_model_wide():
    scores = torch.tensor([[0.1, 0.9, 0.3], [0.8, 0.2, 0.7]])
    chosen = duo_heads.choose_retrieval(scores, 0.5)
    assert chosen.tolist() == [[False, True, False], [True, False, True]]
    assert not duo_heads.choose_retrieval(scores, 0.0).any() and duo_heads.choose_retrieval(scores, 1.0).all()


def test_head_scores_are_the_mass_outside_sinks_and_window_computed_once(tiny, monkeypatch):
    prompt = calibration_prompt(tiny)[:200]
    scores = duo_heads.head_scores(tiny, prompt, 4, 16)
    assert scores.shape == (tiny.spec.num_layers, tiny.spec.num_kv_heads)
    assert ((scores >= 0) & (scores <= 1)).all() and scores.max() > 0
    with pytest.raises(UserError, match="too short"):
        duo_heads.compute_head_scores(tiny, prompt[:20], 4, 16)
    monkeypatch.setattr(duo_heads, "compute_head_scores", lambda *a: pytest.fail("recomputed, not read"))
    assert torch.equal(duo_heads.head_scores(tiny, prompt, 4, 16), scores)


def test_retrieval_heads_on_two_calibration_texts_and_their_overlap(tiny):
    """The stability measurement runs: two texts, the heads each chooses, their overlap."""
    text = calibration_prompt(tiny)
    a = duo_heads.retrieval_heads(tiny, text[:300], 0.5, sink=4, window=16)
    b = duo_heads.retrieval_heads(tiny, text[300:600], 0.5, sink=4, window=16)
    heads = tiny.spec.num_layers * tiny.spec.num_kv_heads
    assert len(a) == len(b) == heads // 2
    assert all(0 <= layer < tiny.spec.num_layers and 0 <= head < tiny.spec.num_kv_heads for layer, head in a)
    assert 0 <= duo_heads.overlap(a, b) <= 1 and duo_heads.overlap(a, a) == 1


def test_the_policy_uses_the_heads_its_calibration_chose(tiny):
    policy = make_policy("duo", retrieval_ratio=0.5, sink=4, window=16, calibration_tokens=300)
    text = calibration_prompt(tiny)
    Engine(tiny, policy, calibration=text).generate(prompts_of(40), 2)
    chosen = duo_heads.retrieval_heads(tiny, text[:300], 0.5, sink=4, window=16)
    assert {(layer, h) for layer, heads in enumerate(policy.retrieval_of) for h in heads} == chosen


@pytest.mark.parametrize("budget", [0.3, 0.5, 0.8])
def test_a_budget_is_the_share_of_the_entries_kept_as_for_every_policy(tiny, budget):
    """Without a retrieval ratio, the budget sets the one at which the prompt keeps that share of its entries once
    prefilled: what the device held per token seen while decoding (KVUsage) is the budget, to within a head's share
    (the ratio rounds to whole heads) and the few tokens decoding adds."""
    prompt, new = prompts_of(200)[0], 4
    s = tiny.spec
    heads = s.num_layers * s.num_kv_heads
    result = Engine(tiny, make_policy("duo", budget=budget, sink=4, window=16)).generate(
        [prompt], new, prefill_mode="chunked", chunk_size=64, stop_at_eos=False)
    ratio = (budget * 200 - 21) / (200 - 21)
    assert result.stats["retrieval_ratio"] == pytest.approx(ratio)
    assert result.stats["retrieval_heads"] == round(ratio * heads)
    held = result.stats["kv_device_bytes_per_token"] / s.kv_bytes_per_token
    assert held == pytest.approx(budget, abs=0.5 / heads + 0.02)


def test_a_budget_below_what_the_streaming_heads_keep_is_ratio_zero(tiny):
    result = Engine(tiny, make_policy("duo", budget=0.05, sink=4, window=16)).generate(
        prompts_of(100), 2, stop_at_eos=False)
    assert result.stats["retrieval_ratio"] == 0 and result.stats["retrieval_heads"] == 0


def test_the_heads_chosen_on_two_passages_of_the_docs(tiny):
    """The stability the accuracy rows record: the same count of heads on each passage, their overlap a share."""
    got = duo_heads.stability(tiny, 0.5, 4, 16, tokens=300)
    assert got["retrieval_heads_chosen"] == tiny.spec.num_layers * tiny.spec.num_kv_heads // 2
    assert 0 <= got["retrieval_heads_overlap"] <= 1


@pytest.mark.parametrize("settings, message", [({"retrieval_ratio": 1.5}, "retrieval_ratio"),
                                               ({"budget_tokens": 32}, "budget_tokens"),
                                               ({"window": 0}, "window"), ({"sink": -1}, "sink")])
def test_bad_settings_are_one_clear_error(settings, message):
    with pytest.raises(UserError, match=message):
        make_policy("duo", **settings)
