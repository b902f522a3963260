"""Budgets split across layers and KV heads (kvlib.policies.allocation) on the scored-eviction mechanism: each rule's
counts, each head's own count read, booked and evicted."""

import types

import pytest
import test_booking
import torch
from prompts import prompts_of as random_prompts

from kvlib.engine import Engine
from kvlib.engine.scheduler import RunSettings, Sequence
from kvlib.errors import UserError
from kvlib.policies import make_policy
from kvlib.policies.allocation import adaptive_counts, pyramid_counts, select_per_head

SETTINGS = {"h2o": {}, "snapkv": {"window": 8}}


def prompts_of(*lengths, seed=1):  # this file's prompts are seed 1's
    return random_prompts(*lengths, seed=seed)


def tokens(result):
    return [o["token_ids"] for o in result.outputs]


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5])
@pytest.mark.parametrize("heavy", [0, 1, 7, 30, 40])
def test_adaptive_counts_stay_above_their_floor_kvpresss_at_the_uniform_total(heavy, alpha):
    torch.manual_seed(heavy)
    scores = torch.rand(3, 4, 40)
    scores[:, 1] *= 10  # one head's scores dominate: it gets more than its uniform share
    floor = int(alpha * heavy)
    for formula in ("adakv", "kvpress"):
        counts = adaptive_counts(scores, heavy, alpha, formula)
        assert (counts >= floor).all() and (counts <= 40).all()
        if 0 < heavy < 40 and alpha < 1:
            assert (counts[:, 1] > heavy).all()
    assert adaptive_counts(scores, heavy, alpha, "kvpress").sum(dim=1).tolist() == [4 * heavy] * 3
    # Ada-KV's: round(c x (1 - alpha) + floor) head by head, c summing to 4 x heavy: off by the floor's rounding
    # down and half an entry a head at most
    ada = adaptive_counts(scores, heavy, alpha, "adakv").sum(dim=1)
    assert ((ada - 4 * heavy).abs() <= 4 * (alpha * heavy - floor) + 2).all()


def test_adaptive_counts_are_each_heads_share_of_the_layers_top_scores():
    """The two rules on one layer whose top 4 pairs are three of head 0's and one of head 1's: Ada-KV's (FFY0) scales
    those shares toward the floor, round(c x (1 - alpha) + floor); kvpress's shape gives the floor first, then the
    best pairs left."""
    scores = torch.tensor([[[9., 8., 7., 1.], [6., 0., 0., 0.]]])
    assert adaptive_counts(scores, 2, 0.0, "adakv").tolist() == [[3, 1]]
    assert adaptive_counts(scores, 2, 0.0, "kvpress").tolist() == [[3, 1]]
    assert adaptive_counts(scores, 2, 0.5, "adakv").tolist() == [[2, 2]]  # round(2.5), round(1.5): half to even
    assert adaptive_counts(scores, 2, 0.5, "kvpress").tolist() == [[3, 1]]  # floor 1 each: head 1's best, then 8, 7
    assert adaptive_counts(scores, 2, 1.0, "adakv").tolist() == [[2, 2]]  # all floor: uniform
    assert adaptive_counts(scores, 2, 1.0, "kvpress").tolist() == [[2, 2]]


@pytest.mark.parametrize("layers, heavy, n", [(4, 10, 40), (30, 50, 60), (4, 10, 12), (5, 12, 12), (1, 9, 20)])
def test_pyramid_counts_fall_with_depth_and_kvlibs_sum_to_the_uniform_total(layers, heavy, n):
    for schedule in ("pyramidkv", "kvlib"):
        counts = pyramid_counts(layers, 3, heavy, n, beta=20, schedule=schedule)
        assert counts.shape == (layers, 3) and (counts == counts[:, :1]).all()
        per_layer = counts[:, 0]
        assert (per_layer <= n).all() and (per_layer[:-1] >= per_layer[1:]).all()
        if schedule == "kvlib":
            assert int(per_layer.sum()) == layers * heavy
        else:  # PyramidKV's step is rounded down: the deeper layers keep more than the line, never less
            assert int(per_layer.sum()) >= layers * heavy
        if 2 * heavy <= n and layers > 1:  # nothing capped: the linear profile down to heavy / beta
            assert per_layer[0] > heavy > per_layer[-1]
            assert int(per_layer[-1]) <= heavy / 20 + (1 if schedule == "kvlib" else layers - 1)


def test_select_per_head_keeps_each_heads_count_then_its_window_in_position_order():
    scores = torch.tensor([[[5., 1., 4., 3., 0., 0.], [1., 2., 3., 9., 0., 0.]]])
    idx = select_per_head(scores, torch.tensor([[2, 0]]), 2)
    assert idx[0, 0].tolist() == [0, 2, 4, 5]
    assert idx[0, 1, :2].tolist() == [4, 5]


@pytest.mark.parametrize("allocation", ["adaptive", "pyramid"])
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_at_budget_one_every_allocation_gives_fulls_tokens(tiny, name, allocation):
    prompts = prompts_of(70, 120, 40)
    full = Engine(tiny, make_policy("full")).generate(prompts, 10, prefill_mode="chunked", chunk_size=32,
                                                      stop_at_eos=False)
    policy = make_policy(name, budget=1.0, allocation=allocation, **SETTINGS[name])
    result = Engine(tiny, policy).generate(prompts, 10, prefill_mode="chunked", chunk_size=32, stop_at_eos=False)
    assert tokens(result) == tokens(full)


def uneven_counts(policy, scores, heavy):
    """An allocation the tiny model's near-uniform attention would not give: per layer, head 0 keeps 3 more older
    tokens than uniform and head 1 three fewer, so the mechanism is tested on heads of different counts."""
    shift = min(3, heavy, scores.shape[-1] - heavy)
    out = torch.full(scores.shape[:2], heavy, dtype=torch.long)
    out[:, 0] += shift
    out[:, 1] -= shift
    return out


def uneven(policy):
    policy.heavy_counts = types.MethodType(uneven_counts, policy)
    return policy


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_heads_keep_their_own_counts_and_the_row_is_booked_at_its_widest_head(tiny, name):
    """The entries are uniform's total, moved between heads; the row's slots are as wide as its widest head in every
    head, and that padding is booked as `kv` (what the device holds for the row: the frontier compares it)."""
    prompt = prompts_of(120)[0]
    uniform = make_policy(name, budget=0.3, **SETTINGS[name])
    adaptive = uneven(make_policy(name, budget=0.3, allocation="adaptive", **SETTINGS[name]))
    held = {}
    for label, policy in (("uniform", uniform), ("adaptive", adaptive)):
        engine = Engine(tiny, policy)
        with engine.session([120], 8) as session:
            token = int(session.prefill(0, prompt, "chunked", chunk_size=32).argmax())
            for _ in range(6):
                token = int(session.decode([0], [token])[0].argmax())
            held[label] = ([[len(h) for h in policy.kept_positions(layer, 0)] for layer in range(4)],
                           engine.ledger.current[("device", "kv")])
    counts, kv = held["adaptive"]
    uniform_counts, uniform_kv = held["uniform"]
    assert all(c[0] == u[0] + 3 and c[1] == u[1] - 3 for c, u in zip(counts, uniform_counts)), (counts, uniform_counts)
    assert kv == uniform_kv + 3 * tiny.spec.kv_bytes_per_token


@pytest.mark.parametrize("allocation", ["adaptive", "pyramid"])
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_the_ledger_books_what_an_allocation_holds(tiny, name, allocation, monkeypatch):
    if allocation == "adaptive":
        monkeypatch.setattr(type(make_policy(name)), "heavy_counts", uneven_counts)
    test_booking.check_census(tiny, name, {"budget": 0.3, "allocation": allocation, **SETTINGS[name]})


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_continuous_batching_under_pyramid_gives_the_static_schedules_tokens(tiny, name):
    prompts = prompts_of(40, 25, 33)
    settings = {"budget": 0.3, "block_size": 4, "allocation": "pyramid", **SETTINGS[name]}
    static = Engine(tiny, make_policy(name, **settings)).generate(prompts, 12, prefill_mode="chunked", chunk_size=16,
                                                                  stop_at_eos=False)
    continuous = RunSettings("continuous", "chunked", chunk_size=16, stop_at_eos=False, share_prompts=True)
    served = Engine(tiny, make_policy(name, **settings)).run([Sequence(p, 12) for p in prompts], continuous)
    assert tokens(served) == tokens(static) and served.stats["allocation"] == "pyramid"


def test_a_later_turn_under_an_uneven_allocation_is_refused(tiny):
    policy = make_policy("h2o", budget=0.3, allocation="pyramid")
    with Engine(tiny, policy).session([200], 8) as session:
        token = int(session.prefill(0, prompts_of(120)[0], "chunked", chunk_size=32).argmax())
        session.decode([0], [token])
        with pytest.raises(UserError, match="later turn"):
            session.prefill(0, prompts_of(20)[0], "chunked", chunk_size=32)


@pytest.mark.parametrize("name, settings, message", [
    ("h2o", {"allocation": "pyramids"}, "allocation"), ("streaming", {"allocation": "adaptive"}, "allocation"),
    ("snapkv", {"floor_alpha": 1.5}, "floor_alpha"), ("h2o", {"pyramid_beta": 0.5}, "pyramid_beta")])
def test_bad_allocation_settings_are_one_clear_error(name, settings, message):
    with pytest.raises(UserError, match=message):
        make_policy(name, **settings)


@pytest.mark.model
def test_on_smollm_adaptive_moves_tokens_between_heads(smollm):
    """SmolLM2's heads attend differently: Ada-KV's counts differ from head to head; kvpress's shape keeps the
    uniform total, FFY0's rounds each head's count (kvlib.policies.allocation)."""
    from kvlib.models.workloads import prompt_of_length
    prompt = prompt_of_length(smollm.tokenizer, 300)
    for formula in ("adakv", "kvpress"):
        policy = make_policy("adakv", budget=0.2, window=16, formula=formula)
        with Engine(smollm, policy).session([300], 2) as session:
            session.prefill(0, prompt, "chunked", chunk_size=128)
            delta = policy.delta[:, 0]
            assert delta.abs().sum() > 0
            if formula == "kvpress":
                assert (delta.sum(dim=1) == 0).all()
            else:
                assert (delta.sum(dim=1).abs() <= smollm.spec.num_kv_heads).all()


@pytest.mark.parametrize("name", ["adakv", "pyramidkv"])
def test_rows_forked_off_a_prompt_fit_the_pool_under_an_uneven_allocation(tiny, name):
    """lm-eval's multiple choice forks each context's row once per choice: the pool sized at start holds every row at
    its widest head's count (a uniform count per row ran out of blocks)."""
    g = torch.Generator().manual_seed(1)
    contexts = [torch.randint(100, 5000, (n,), generator=g).tolist() for n in (200, 180)]
    prompts = [c for c in contexts for _ in range(4)]
    forced = [[100 + i, 200 + i] for i in range(len(prompts))]
    for budget in (0.1, 0.5):
        result = Engine(tiny, make_policy(name, budget=budget, window=8)).generate(
            prompts, 0, prefill_mode="chunked", chunk_size=64, forced=forced, share_prompts=True)
        assert result.oom is None and len(result.outputs) == len(prompts)
