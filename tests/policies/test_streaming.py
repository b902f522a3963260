"""StreamingLLM: attention sinks + recent window, checked against a replay with explicit lists."""

import pytest
import torch

from kvlib.engine import Engine
from kvlib.errors import UserError
from kvlib.policies import make_policy
from kvlib.policies.streaming import rotate


def record_kept(policy, rows=(0, 1)):
    """Kept positions of every (layer, row) after each prefill and decode pass; and how often `select` ran."""
    history, calls = [], []
    after, select = policy.after_pass, policy.select

    def after_pass(step):
        after(step)
        if step.last_chunk:
            history.append((step.phase, [int(r) for r in step.rows], int(step.start.max()) + step.q_len,
                            {(layer, r): policy.kept_positions(layer, r)
                             for layer in range(policy.spec.num_layers) for r in rows}))

    def counting_select(scores, heavy, recent):
        calls.append((scores.shape[-1], heavy, recent))
        return select(scores, heavy, recent)
    policy.after_pass, policy.select = after_pass, counting_select
    return history, calls


def replay(prompt_lens, new_tokens, budget, sink):
    """What each row should hold: a list of positions, trimmed by dropping the oldest non-sink while over budget."""
    held = {row: [] for row in range(len(prompt_lens))}
    seen = dict.fromkeys(held, 0)
    snapshots = []

    def trim(row):
        allowed = min(seen[row], max(1, round(budget * seen[row])))
        while len(held[row]) > allowed:
            held[row].remove(min(p for p in held[row] if p >= sink))

    for row, n in enumerate(prompt_lens):
        held[row] = list(range(n))
        seen[row] = n
        trim(row)
        snapshots.append({r: set(held[r]) for r in held})
    for _ in range(new_tokens - 1):  # the last generated token is never fed back
        for row in range(len(prompt_lens)):
            held[row].append(seen[row])
            seen[row] += 1
            trim(row)
        snapshots.append({r: set(held[r]) for r in held})
    return snapshots


@pytest.mark.parametrize("scheme", ["original", "cache"])
def test_kept_sets_match_a_replay_after_prefill_and_decode(tiny, scheme):
    torch.manual_seed(1)
    lens = (41, 26)
    prompts = [torch.randint(100, 5000, (n,)).tolist() for n in lens]
    policy = make_policy("streaming", budget=0.4, sink=3, position_scheme=scheme)
    history, _ = record_kept(policy)
    Engine(tiny, policy).generate(prompts, 7, prefill_mode="chunked", chunk_size=8, stop_at_eos=False)
    expected = replay(lens, 7, 0.4, 3)
    assert len(history) == len(expected) == 2 + 6
    for (phase, rows, _, got), want in zip(history, expected):
        for row in rows:
            for layer in range(tiny.spec.num_layers):
                assert all(heads == want[row] for heads in got[(layer, row)]), (phase, row, layer)
    # the middle really went: row 0 keeps 3 sinks and a window, nothing between
    assert set(range(3)) <= expected[-1][0] and 10 not in expected[-1][0]


@pytest.mark.model
@pytest.mark.parametrize("scheme", ["original", "cache"])
def test_budget_one_equals_full_through_the_selection(smollm, mixed_prompts, scheme):
    full = Engine(smollm, make_policy("full")).generate(mixed_prompts, 16)
    for mode in ("fused", "chunked"):
        policy = make_policy("streaming", budget=1.0, position_scheme=scheme)
        _, calls = record_kept(policy, rows=())
        got = Engine(smollm, policy).generate(mixed_prompts, 16, prefill_mode=mode, chunk_size=5)
        assert [o["token_ids"] for o in got.outputs] == [o["token_ids"] for o in full.outputs]
        assert len(calls) == len(mixed_prompts)  # one selection per prompt, keeping everything
        assert all(n == policy.sink + recent for n, _, recent in calls)


def test_cache_positions_are_rotary_at_the_rank_in_the_cache(tiny):
    """Re-rotating a key embedded at text position p by (rank - p) gives the key embedded at its rank, for the model's
    own rotary embedding."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rotary = tiny.model.model.rotary_emb
    torch.manual_seed(3)
    raw = torch.randn(1, 2, 5, tiny.spec.head_dim)
    text_pos = torch.tensor([[0, 1, 17, 30, 31]])
    rank = torch.arange(5)[None]
    cos, sin = rotary(raw, text_pos)
    at_text, _ = apply_rotary_pos_emb(raw, raw, cos, sin)
    cos, sin = rotary(raw, rank)
    at_rank, _ = apply_rotary_pos_emb(raw, raw, cos, sin)
    moved = rotate(at_text, (rank - text_pos)[:, None, :].expand(1, 2, 5), rotary.inv_freq.float())
    assert torch.allclose(moved, at_rank, atol=1e-5)
    assert not torch.allclose(at_text, at_rank, atol=1e-3)


def test_the_position_schemes_agree_until_something_is_evicted(tiny):
    torch.manual_seed(4)
    prompt = [torch.randint(100, 5000, (60,)).tolist()]
    cont = [torch.randint(100, 5000, (5,)).tolist()]

    def logprobs(scheme, budget):
        policy = make_policy("streaming", budget=budget, position_scheme=scheme)
        return Engine(tiny, policy).generate(prompt, 1, prefill_mode="fused", forced=cont).outputs[0]["logprobs"]

    assert logprobs("cache", 1.0) == pytest.approx(logprobs("original", 1.0), abs=1e-5)
    sparse_original, sparse_cache = logprobs("original", 0.3), logprobs("cache", 0.3)
    assert max(abs(a - b) for a, b in zip(sparse_original, sparse_cache)) > 1e-4


@pytest.mark.parametrize("settings, message", [
    ({"sink": -1}, "sink must be"),
    ({"position_scheme": "relative"}, "position_scheme must be"),
    ({"budget_tokens": 4, "sink": 4}, "must exceed sink"),
    ({"budget": 0.0}, "budget must be in"),
])
def test_bad_settings_are_one_clear_error(settings, message):
    with pytest.raises(UserError, match=message):
        make_policy("streaming", **settings)
