"""H2O: heavy hitters + recent window, checked against a brute-force reference written with explicit loops."""

import math

import pytest
import torch

from kvlib.engine import Engine
from kvlib.errors import UserError
from kvlib.policies import make_policy


class Recorder:
    """Wraps a policy: records the queries/keys it is handed and the kept positions after every pass."""

    def __init__(self, policy):
        self.policy, self.calls, self.kept = policy, [], []
        attend, after = policy.attend, policy.after_pass

        def recording_attend(layer, q, k, v, step):
            self.calls.append((layer, step.phase, step.rows.clone(), step.start.clone(), q.clone(), k.clone()))
            return attend(layer, q, k, v, step)

        def recording_after(step):
            after(step)
            if step.last_chunk:
                self.kept.append((step.phase, {(layer, int(row)): policy.kept_positions(layer, int(row))
                                               for layer in range(policy.spec.num_layers) for row in step.rows}))

        policy.attend, policy.after_pass = recording_attend, recording_after


def brute_force_kept(calls, prompt_lens, n_layers, n_kv, group, scale, budget, recent_ratio):
    """Replays the recorded queries/keys with explicit loops; returns the kept sets after each prompt's prefill and
    after every decode step, like Recorder."""
    keys = {}  # (layer, row, head) -> {position: key vector}
    score = {}  # (layer, row, head) -> {position: accumulated attention}
    seen = {}
    history = []
    passes = {}
    for layer, phase, rows, starts, q, k in calls:
        passes.setdefault((phase, tuple(rows.tolist()), tuple(starts.tolist())), []).append((layer, q, k))
    for (phase, rows, starts), layers in passes.items():
        for layer, q, k in layers:
            for b, (row, start) in enumerate(zip(rows, starts)):
                for h in range(n_kv):
                    cache, acc = keys.setdefault((layer, row, h), {}), score.setdefault((layer, row, h), {})
                    for t in range(k.shape[2]):
                        cache[start + t] = k[b, h, t]
                        acc.setdefault(start + t, 0.0)
                    for t in range(q.shape[2]):
                        visible = [p for p in cache if p <= start + t]
                        for g in range(group):
                            qv = q[b, h * group + g, t]
                            logits = torch.tensor([float(qv @ cache[p]) * scale for p in visible])
                            for p, w in zip(visible, torch.softmax(logits, 0).tolist()):
                                acc[p] += w
        snapshot = {}
        for row, start in zip(rows, starts):
            seen[row] = start + (layers[0][1].shape[2])
            if phase == "prefill" and seen[row] < prompt_lens[row]:
                continue  # the prompt's tokens are all held until its last chunk
            keep = min(seen[row], max(1, round(budget * seen[row])))
            recent = round(keep * recent_ratio)
            for layer in range(n_layers):
                kept_heads = []
                for h in range(n_kv):
                    cache, acc = keys[(layer, row, h)], score[(layer, row, h)]
                    while len(cache) > keep:
                        older = [p for p in cache if p < seen[row] - recent]
                        if phase == "prefill":  # keep the `heavy` best of the older ones
                            victim = min(older, key=lambda p: (acc[p], -p))
                        else:
                            victim = min(older, key=lambda p: (acc[p], p))
                        del cache[victim], acc[victim]
                    kept_heads.append(set(cache))
                snapshot[(layer, row)] = kept_heads
        if snapshot:
            history.append((phase, snapshot))
    return history


@pytest.mark.parametrize("mode", ["full", "chunked"])
def test_kept_sets_match_brute_force_reference(tiny, mode):
    torch.manual_seed(1)
    prompts = [torch.randint(100, 5000, (n,)).tolist() for n in (23, 17)]
    policy = make_policy("h2o", budget=0.5)
    rec = Recorder(policy)
    Engine(tiny, policy).generate(prompts, 6, prefill_mode=mode, chunk_size=8, stop_at_eos=False)
    spec = tiny.spec
    expected = brute_force_kept(rec.calls, [len(p) for p in prompts], spec.num_layers, spec.num_kv_heads,
                                spec.num_attention_heads // spec.num_kv_heads, spec.head_dim ** -0.5, 0.5, 0.5)
    assert len(rec.kept) == len(expected) == 2 + 5  # two prefills, five decode steps
    for (phase, got), (_, want) in zip(rec.kept, expected):
        assert got == want, phase


@pytest.mark.model
def test_budget_one_equals_full(smollm, mixed_prompts):
    full = Engine(smollm, make_policy("full")).generate(mixed_prompts, 16)
    for mode in ("full", "chunked"):
        h2o = Engine(smollm, make_policy("h2o", budget=1.0)).generate(mixed_prompts, 16, prefill_mode=mode,
                                                                      chunk_size=5)
        assert [o["token_ids"] for o in h2o.outputs] == [o["token_ids"] for o in full.outputs]


def test_kv_bytes_follow_the_budget_and_stay_bounded(tiny):
    prompts = [list(range(200, 300)), list(range(400, 460))]
    policy = make_policy("h2o", budget=0.3)
    engine = Engine(tiny, policy)
    per_token = tiny.spec.kv_bytes_per_token
    booked = []
    after = policy.after_pass
    policy.after_pass = lambda step: (after(step), booked.append((policy.tokens.seen.clone(), engine.ledger.current[
        ("device", "kv")])))
    engine.generate(prompts, 12, prefill_mode="full", stop_at_eos=False)
    _, after_prefill = booked[1]
    assert abs(after_prefill - (0.3 * 100 + 0.3 * 60) * per_token) <= 2 * per_token  # one token per row
    for seen, kv in booked[2:]:
        assert kv <= sum(math.ceil(0.3 * int(n)) for n in seen) * per_token
        assert kv < 0.35 * int(seen.sum()) * per_token


def test_cross_chunk_accumulation_recovers_full_prefill_kept_set(tiny):
    torch.manual_seed(2)
    prompt = torch.randint(100, 5000, (96,)).tolist()

    def kept(mode, chunk, scoring):
        policy = make_policy("h2o", budget=0.25, chunk_scoring=scoring)
        rec = Recorder(policy)
        Engine(tiny, policy).generate([prompt], 1, prefill_mode=mode, chunk_size=chunk)
        _, after_prefill = rec.kept[0]
        return [after_prefill[(layer, 0)] for layer in range(tiny.spec.num_layers)]

    def overlap(a, b):
        pairs = [(x, y) for la, lb in zip(a, b) for x, y in zip(la, lb)]
        return sum(len(x & y) for x, y in pairs) / sum(len(x) for x, _ in pairs)

    reference = kept("full", 0, "accumulate")
    assert kept("chunked", 96, "accumulate") == reference
    assert kept("chunked", 96, "per_chunk") == reference  # one chunk: both variants are full prefill
    accumulate, per_chunk = kept("chunked", 16, "accumulate"), kept("chunked", 16, "per_chunk")
    assert overlap(accumulate, reference) == 1.0
    assert overlap(per_chunk, reference) < 1.0


@pytest.mark.parametrize("settings, mode, message", [
    ({"budget": 0.0}, "full", "budget must be in"),
    ({"budget": 1.5}, "full", "budget must be in"),
    ({"budget_tokens": 50}, "full", "exceeds the shortest prompt"),
    ({}, "fused", "fused prefill"),
    ({"chunk_scoring": "sometimes"}, "full", "chunk_scoring"),
])
def test_bad_input(tiny, settings, mode, message):
    with pytest.raises(UserError, match=message):
        Engine(tiny, make_policy("h2o", **settings)).generate([list(range(10, 40))], 2, prefill_mode=mode)


def test_flexgen_rule_keeps_heavy_and_recent_of_the_prompt_fixed_during_decode(tiny):
    """FlexGen's H2O, as the paper ran it: int(ratio x prompt) heavy hitters and as many recent tokens, every step."""
    torch.manual_seed(6)
    prompts = [torch.randint(100, 5000, (n,)).tolist() for n in (100, 57)]
    policy = make_policy("h2o", budget=0.3, budget_rule="flexgen")
    kept, last = [], {}
    original = policy.after_pass

    def after_pass(step):
        original(step)
        if step.phase == "decode":
            kept.append(policy.kept.tolist())
            last.update({row: [policy.kept_positions(layer, row) for layer in range(tiny.spec.num_layers)]
                         for row in (0, 1)})
    policy.after_pass = after_pass
    Engine(tiny, policy).generate(prompts, 12, prefill_mode="chunked", chunk_size=32, stop_at_eos=False)
    assert len(kept) == 11 and all(k == [2 * int(0.3 * 100), 2 * int(0.3 * 57)] for k in kept)
    for row, n in enumerate((100, 57)):
        seen = n + 11  # the prompt and the 11 decoded tokens fed back
        for heads in last[row]:
            for kept_positions in heads:
                assert set(range(seen - int(0.3 * n), seen)) <= kept_positions  # the recent window


def test_room_for_the_whole_prompt_is_booked_before_any_attention_is_computed(tiny):
    """The pool holds the longest prompt in full while it is prefilled (H2O scores it all before it evicts): a
    capacity with room for the budgeted cache but not for that fails at setup, before any compute."""
    prompt = [list(range(100, 400))]
    policy = make_policy("h2o", budget=0.1)
    fits = Engine(tiny, make_policy("h2o", budget=0.1)).generate(prompt, 2, prefill_mode="chunked", chunk_size=64)
    assert fits.memory["device"]["components"]["kv"] == 30 * tiny.spec.kv_bytes_per_token  # 0.1 x 300 kept
    cache = fits.memory["device"]["peak_components"]["kv_reserved"] + fits.memory["device"]["peak_components"]["kv"]
    assert cache >= tiny.spec.kv_bytes(300)
    capacity = tiny.weights_bytes + tiny.packed_copy_bytes + cache // 2  # room for the budgeted cache, not for the whole prompt
    result = Engine(tiny, policy, device_capacity_bytes=capacity).generate(prompt, 2, prefill_mode="chunked",
                                                                          chunk_size=64)
    assert result.oom is not None and result.oom["where"] == "h2o KV pool" and result.oom["phase"] == "setup"
    assert result.memory["device"]["peak_components"]["activations"] == 0  # before any attention matrix was booked
