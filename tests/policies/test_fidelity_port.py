"""FlexGen + H2O against the H2O authors' FlexGen port (FMInference/H2O@ac75c2a h2o_flexgen, `--hh-all`), its rule
re-stated here from flex_opt.py and pytorch_backend.py: hh_k = int(hh_ratio x prompt); the prompt keeps the hh_k
best-scored of its entries but the last hh_k - 1, then those (`_heavy_hitter_pruning`); a decode step reads 2 hh_k
slots (hh_k heavy, hh_k - 1 recent, the new token last), adds its attention to `acc` (the new slot's first zeroed),
takes the lowest `acc` of the heavy slots (`_get_light_hitter` on acc[:src_s - hh_k]), and moves the oldest recent
entry into that slot and the new token into the oldest's (`cache_replace`, `acc_replace`); hh_k = 0 is asserted away.
And kvlib's own rule (`eviction="h2o"`), and the 4-bit cache off the device, which the port has not."""

import pytest
import torch

from kvlib.engine import Engine
from kvlib.errors import UserError
from kvlib.memory import quant4
from kvlib.policies import make_policy
from kvlib.policies.base import Step

ON_DEVICE = "100 0 100 0 100 0"
KV_ON_HOST = "100 0 0 100 100 0"  # FlexGen's words: weights on the device, the cache on the host
PROMPT, STEPS, BUDGET = 12, 10, 0.25  # hh_k = int(0.25 x 12) = 3


def inputs(spec, seed=0):
    """Queries, keys and values of a prompt and of STEPS decode tokens, peaked enough that the scores spread."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d = spec.num_attention_heads, spec.num_kv_heads, spec.head_dim
    n = PROMPT + STEPS
    q, k, v = (3 * torch.randn(1, h, n, d, generator=g) for h in (hq, hkv, hkv))
    return q, k, v


def attention(q, k, scale):
    """One KV head: q [G, T, D] (its group's query heads) over k [L, D], the queries the last T of L, causal; the
    probabilities summed over the group's heads and the queries, per key [L] (the port: per head, MHA)."""
    t, n = q.shape[1], k.shape[0]
    mask = torch.arange(n)[None, :] <= torch.arange(n - t, n)[:, None]
    scores = (q @ k.T * scale).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.double(), dim=-1).sum(dim=(0, 1))


def port(q, k, hh_k, scale):
    """The port's cache of one KV head after each decode step: {original position: acc}. q [G, N, D], k [N, D]."""
    aggr = attention(q[:, :PROMPT], k[:PROMPT], scale)
    heavy = aggr[:PROMPT - hh_k + 1].topk(hh_k).indices.tolist()
    slots = heavy + list(range(PROMPT - hh_k + 1, PROMPT))  # hh_k heavy, then the hh_k - 1 recent
    acc = [float(aggr[p]) for p in slots]
    after = []
    for i in range(1, STEPS + 1):
        new = PROMPT + i - 1
        read = slots + [new]
        w = attention(q[:, new:new + 1], k[read], scale)
        acc = [a + float(x) for a, x in zip(acc + [0.0], w)]
        victim = min(range(hh_k), key=lambda j: acc[j])
        oldest = hh_k + (i - 1) % (hh_k - 1)
        slots[victim], acc[victim] = slots[oldest], acc[oldest]
        slots[oldest], acc[oldest] = new, acc[-1]
        acc = acc[:-1]
        after.append(dict(zip(slots, acc)))
    return after


def kvlib_h2o(q, k, hh_k, scale):
    """kvlib's `h2o` rule under budget_rule flexgen: 2 hh_k kept (hh_k heavy, the hh_k newest), the new token read
    beside them, the lowest score older than the window evicted."""
    aggr = attention(q[:, :PROMPT], k[:PROMPT], scale)
    heavy = aggr[:PROMPT - hh_k].topk(hh_k).indices.tolist()
    kept = {p: float(aggr[p]) for p in heavy + list(range(PROMPT - hh_k, PROMPT))}
    after = []
    for new in range(PROMPT, PROMPT + STEPS):
        kept[new] = 0.0
        read = sorted(kept)
        for p, x in zip(read, attention(q[:, new:new + 1], k[read], scale)):
            kept[p] += float(x)
        victim = min((p for p in kept if p <= new - hh_k), key=kept.get)
        del kept[victim]
        after.append(dict(kept))
    return after


def drive(model, policy, q, k, v):
    """Feed the policy a prompt's and STEPS tokens' q, k, v on every layer, as the engine's forward does; after each
    decode step, layer 0's {position: score} per KV head."""
    Engine(model, policy)
    policy.rows = 1
    policy.start(1, [PROMPT], STEPS + 1)
    after = []
    try:
        row, layers = torch.tensor([0]), model.spec.num_layers
        step = Step(policy, row, torch.tensor([0]), PROMPT, "prefill", "full", end=torch.tensor([PROMPT]))
        passes = [(step, slice(0, PROMPT))]
        passes += [(Step(policy, row, torch.tensor([n]), 1, "decode", end=torch.tensor([n + 1])), slice(n, n + 1))
                   for n in range(PROMPT, PROMPT + STEPS)]
        for i, (step, at) in enumerate(passes):
            policy.prepare(step)
            for layer in range(layers):
                policy.attend(layer, q[:, :, at], k[:, :, at], v[:, :, at], step)
            policy.after_pass(step)
            if i:
                unit = policy.unit(0, 0)
                pos, score = unit["positions"][0], unit["scores"][0]
                after.append([{int(p): float(s) for p, s in zip(pos[h], score[h]) if p >= 0}
                              for h in range(model.spec.num_kv_heads)])
    finally:
        policy.finish()
    return after


@pytest.mark.parametrize("eviction", ["port", "h2o"])
def test_the_slots_hold_what_the_rule_keeps_after_each_step(tiny, tmp_path, eviction):
    """By default (no setting) the port's slots; `eviction="h2o"` kvlib's h2o's. The same entries, the same
    accumulated scores, after every decode step, on every KV head."""
    spec = tiny.spec
    q, k, v = inputs(spec)
    settings = {} if eviction == "port" else {"eviction": "h2o"}
    policy = make_policy("flexgen_h2o", budget=BUDGET, percent=ON_DEVICE, offload_dir=str(tmp_path), **settings)
    mine = drive(tiny, policy, q, k, v)
    hh_k, g = int(BUDGET * PROMPT), spec.num_attention_heads // spec.num_kv_heads
    rule = port if eviction == "port" else kvlib_h2o
    for h in range(spec.num_kv_heads):
        theirs = rule(q[0, h * g:(h + 1) * g], k[0, h], hh_k, spec.head_dim ** -0.5)
        for i, (ours, expected) in enumerate(zip((m[h] for m in mine), theirs)):
            assert len(ours) == (2 * hh_k - 1 if eviction == "port" else 2 * hh_k)
            assert sorted(ours) == sorted(expected), f"head {h}, decode step {i + 1}"
            assert [ours[p] for p in sorted(ours)] == pytest.approx([expected[p] for p in sorted(ours)], rel=1e-4)


def test_a_budget_that_keeps_no_heavy_hitter_is_refused(tiny, tmp_path):
    """The port asserts int(prompt_len x hh_ratio) > 0: 0.1 x 9 tokens is refused, 0.1 x 10 runs."""
    for settings in ({}, {"eviction": "h2o"}):
        policy = make_policy("flexgen_h2o", budget=0.1, offload_dir=str(tmp_path), **settings)
        with pytest.raises(UserError, match="hh_k = 0"):
            Engine(tiny, policy).generate([list(range(100, 109))], 2, prefill_mode="full", stop_at_eos=False)
    policy = make_policy("flexgen_h2o", budget=0.1, offload_dir=str(tmp_path))
    Engine(tiny, policy).generate([list(range(100, 110))], 2, prefill_mode="full", stop_at_eos=False)


def test_an_unknown_eviction_is_one_clear_error():
    with pytest.raises(UserError, match="eviction must be one of"):
        make_policy("flexgen_h2o", eviction="lru")


def test_the_4bit_cache_on_the_host_keeps_the_ports_slots_and_stays_close(tiny, tmp_path):
    """kvlib's extension (the port's compressed device takes no H2O cache): FlexGen's 4-bit groups with the cache on
    the host. Every row holds 2 hh_k - 1 entries after each decode step; the host books the 4-bit records and their
    scores and positions, the device none of it; the tokens stay close to the uncompressed run's."""
    torch.manual_seed(0)
    lengths = (40, 65, 23)
    prompts = [torch.randint(100, 5000, (n,)).tolist() for n in lengths]
    plain = Engine(tiny, make_policy("flexgen_h2o", budget=0.2, percent=KV_ON_HOST, offload_dir=str(tmp_path)))
    reference = plain.generate(prompts, 8, prefill_mode="full", stop_at_eos=False)
    policy = make_policy("flexgen_h2o", budget=0.2, percent=KV_ON_HOST, compress_cache=True,
                         offload_dir=str(tmp_path))
    held, after_pass = [], policy.after_pass

    def counting(step):
        after_pass(step)
        if step.phase == "decode":
            held.append(dict(zip(step.rows.tolist(), policy.kept[step.rows].tolist())))
    policy.after_pass = counting
    result = Engine(tiny, policy).generate(prompts, 8, prefill_mode="full", stop_at_eos=False)
    assert held and all(n == 2 * int(0.2 * lengths[r]) - 1 for step in held for r, n in step.items())
    s = tiny.spec
    slot = 2 * quant4.record_bytes(s.head_dim) + 4 + 8  # 4-bit key and value, fp32 score, int64 position
    host = result.memory["host"]["components"]
    assert host["kv"] + host["kv_reserved"] == len(lengths) * s.num_layers * s.num_kv_heads * policy.capacity * slot
    device = result.memory["device"]["peak_components"]
    assert device.get("kv", 0) == device.get("kv_reserved", 0) == 0
    assert result.stats["host_to_device_bytes"] > 0
    ours = [o["token_ids"] for o in result.outputs]
    theirs = [o["token_ids"] for o in reference.outputs]
    agree = sum(a == b for x, y in zip(ours, theirs) for a, b in zip(x, y))
    assert agree >= 0.5 * len(lengths) * 8  # lossy but close (a random 4-layer model)
