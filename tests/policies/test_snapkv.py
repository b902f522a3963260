"""SnapKV: the observation window's pooled votes, checked against a brute-force reference written with loops."""

import pytest
import torch

from kvlib.engine import Engine
from kvlib.errors import UserError
from kvlib.policies import make_policy


class Recorder:
    """Records the queries/keys a policy is handed and its kept positions after each prompt and decode step."""

    def __init__(self, policy):
        self.calls, self.kept, self.selections = [], [], []
        attend, after, select = policy.attend, policy.after_pass, policy.select

        def recording_attend(layer, q, k, v, step):
            self.calls.append((layer, step.phase, int(step.rows[0]), int(step.start[0]), q.clone(), k.clone()))
            return attend(layer, q, k, v, step)

        def recording_after(step):
            after(step)
            if step.last_chunk:
                self.kept.append({(layer, r): policy.kept_positions(layer, r)
                                  for layer in range(policy.spec.num_layers) for r in (0, 1)})

        def recording_select(scores, heavy, recent):
            self.selections.append((heavy, recent))
            return select(scores, heavy, recent)
        policy.attend, policy.after_pass, policy.select = recording_attend, recording_after, recording_select


def reference_prompt_kept(calls, row, length, layer, spec, budget, window, kernel):
    """Per KV head, the positions SnapKV keeps of a prompt: loops over heads, window queries and positions."""
    q = torch.cat([c[4][0] for c in calls if c[:3] == (layer, "prefill", row)], dim=1)  # [Hq, length, D]
    k = torch.cat([c[5][0] for c in calls if c[:3] == (layer, "prefill", row)], dim=1)  # [Hkv, length, D]
    keep = min(length, max(1, round(budget * length)))
    w = min(window, length)
    recent = min(window, keep)
    group = spec.num_attention_heads // spec.num_kv_heads
    kept = []
    for h in range(spec.num_kv_heads):
        pooled_sum = [0.0] * (length - w)
        for g in range(group):
            votes = [0.0] * (length - w)
            for t in range(length - w, length):
                logits = torch.tensor([float(q[h * group + g, t] @ k[h, p]) for p in range(t + 1)]) * spec.head_dim ** -0.5
                probs = torch.softmax(logits, 0).tolist()
                for p in range(length - w):
                    votes[p] += probs[p]
            for p in range(length - w):  # avg pooling, zero padding counted in the mean
                around = [votes[i] for i in range(p - kernel // 2, p + kernel // 2 + 1) if 0 <= i < length - w]
                pooled_sum[p] += sum(around) / kernel / group
        older = length - recent
        best = sorted(range(older), key=lambda p: -pooled_sum[p])[:keep - recent]
        kept.append(set(best) | set(range(older, length)))
    return kept


def test_kept_sets_match_brute_force_after_prefill_and_decode(tiny):
    torch.manual_seed(1)
    lens = (23, 17)
    prompts = [torch.randint(100, 5000, (n,)).tolist() for n in lens]
    policy = make_policy("snapkv", budget=0.6, window=6, kernel_size=3)
    rec = Recorder(policy)
    Engine(tiny, policy).generate(prompts, 6, prefill_mode="chunked", chunk_size=4, stop_at_eos=False)
    assert len(rec.kept) == 2 + 5
    assert [s for s in rec.selections] == [(8, 6), (4, 6)]  # heavy hitters picked by votes in both rows
    for row, n in enumerate(lens):
        for layer in range(tiny.spec.num_layers):
            want = reference_prompt_kept(rec.calls, row, n, layer, tiny.spec, 0.6, 6, 3)
            assert rec.kept[row][(layer, row)] == want, (row, layer)
            assert len(want[0]) < n
            for step, snapshot in enumerate(rec.kept[2:], start=1):  # decode appends, evicts nothing
                assert snapshot[(layer, row)] == [heads | set(range(n, n + step)) for heads in want]


def test_heads_of_a_group_share_one_copy(tiny):
    """One kept set per KV head (not per query head): the cache holds Hkv x kept entries."""
    torch.manual_seed(2)
    prompt = [torch.randint(100, 5000, (64,)).tolist()]
    policy = make_policy("snapkv", budget=0.25, window=8)
    engine = Engine(tiny, policy)
    booked = []
    after = policy.after_pass
    policy.after_pass = lambda step: (after(step), booked.append((engine.ledger.current[("device", "kv")],
                                                                  policy.positions.shape[1])))
    engine.generate(prompt, 1, prefill_mode="fused")
    kv, heads = booked[-1]
    assert heads == tiny.spec.num_kv_heads
    assert kv == 16 * tiny.spec.kv_bytes_per_token  # round(0.25 x 64) tokens, every layer and KV head


@pytest.mark.model
def test_budget_one_equals_full_through_the_votes(smollm, mixed_prompts):
    full = Engine(smollm, make_policy("full")).generate(mixed_prompts, 16)
    for mode in ("fused", "chunked"):
        policy = make_policy("snapkv", budget=1.0, window=4)
        rec = Recorder(policy)
        got = Engine(smollm, policy).generate(mixed_prompts, 16, prefill_mode=mode, chunk_size=3)
        assert [o["token_ids"] for o in got.outputs] == [o["token_ids"] for o in full.outputs]
        assert [heavy for heavy, _ in rec.selections] == [len(p) - 4 for p in mixed_prompts]


def test_a_small_budget_changes_the_scores(tiny):
    torch.manual_seed(4)
    prompt = [torch.randint(100, 5000, (80,)).tolist()]
    cont = [torch.randint(100, 5000, (6,)).tolist()]
    full = Engine(tiny, make_policy("full")).generate(prompt, 1, forced=cont).outputs[0]["logprobs"]
    sparse = Engine(tiny, make_policy("snapkv", budget=0.2, window=4)).generate(prompt, 1, forced=cont)
    assert max(abs(a - b) for a, b in zip(sparse.outputs[0]["logprobs"], full)) > 1e-3


@pytest.mark.parametrize("settings, message", [
    ({"window": 0}, "window must be"),
    ({"kernel_size": 4}, "kernel_size must be an odd"),
    ({"pooling": "median"}, "pooling must be"),
    ({"budget": 1.2}, "budget must be in"),
])
def test_bad_settings_are_one_clear_error(settings, message):
    with pytest.raises(UserError, match=message):
        make_policy("snapkv", **settings)
