"""The engine with the full-cache baseline on the embedded model."""

import pytest
import torch
from conftest import hf_greedy

from kvlib.engine import Engine
from kvlib.engine.scheduler import BATCHING
from kvlib.errors import UserError
from kvlib.policies import available, make_policy

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def reference(smollm, mixed_prompts):
    return [hf_greedy(smollm, p, NEW_TOKENS) for p in mixed_prompts]


@pytest.mark.model
@pytest.mark.parametrize("mode", ["full", "fused", "chunked"])
def test_full_policy_matches_transformers_generate(smollm, mixed_prompts, reference, mode):
    result = Engine(smollm, make_policy("full")).generate(mixed_prompts, NEW_TOKENS, prefill_mode=mode, chunk_size=7)
    assert [o["token_ids"] for o in result.outputs] == reference


@pytest.mark.model
def test_kv_bytes_follow_the_formula_and_weights_the_parameters(smollm, mixed_prompts):
    result = Engine(smollm, make_policy("full")).generate(mixed_prompts, 8, stop_at_eos=False)
    spec = smollm.spec
    # the last generated token is never fed back, so it is not cached
    cached = sum(len(p) + len(o["token_ids"]) - 1 for p, o in zip(mixed_prompts, result.outputs))
    expected = spec.num_layers * spec.num_kv_heads * cached * spec.head_dim * 4 * 2
    assert result.memory["device"]["kv_bytes"] == expected
    held = sum(p.numel() * p.element_size() for p in smollm.model.parameters())
    config = smollm.model.config
    # the tied LM head's packed copy is booked apart: the vocabulary x hidden floats of the table it copies
    packed = config.vocab_size * config.hidden_size * 4 if config.tie_word_embeddings else 0
    components = result.memory["device"]["components"]
    assert (components["weights"], components["weights_packed"]) == (held - packed, packed) and packed > 0
    # contiguous rows reserve prompt + max_new_tokens each: the slack is booked apart from the live KV
    reserved = result.memory["device"]["components"]["kv_reserved"]
    assert reserved == spec.kv_bytes(len(mixed_prompts) * (max(map(len, mixed_prompts)) + 8)) - expected


@pytest.mark.model
def test_full_matrix_prefill_hits_capacity_where_fused_fits(smollm):
    prompt = list(range(1000, 2500))  # 1,500 tokens: the 9-head fp32 score matrix alone is ~160 MB
    capacity = smollm.weights_bytes + smollm.packed_copy_bytes + 140 * 2**20
    full = Engine(smollm, make_policy("full"), device_capacity_bytes=capacity).generate([prompt], 2, prefill_mode="full")
    assert full.oom is not None and full.oom["phase"] == "prefill"
    assert "attention matrix" in full.oom["where"]
    assert not full.metrics["completed"]
    fused = Engine(smollm, make_policy("full"), device_capacity_bytes=capacity).generate([prompt], 2,
                                                                                          prefill_mode="fused")
    assert fused.oom is None and len(fused.outputs[0]["token_ids"]) == 2
    assert fused.memory["device"]["peak_bytes"] <= capacity


@pytest.mark.model
def test_metrics_are_consistent(smollm, mixed_prompts):
    m = Engine(smollm, make_policy("full")).generate(mixed_prompts, 6, stop_at_eos=False).metrics
    assert m["decode_tokens"] == 3 * 5 and m["decode_steps"] == 5
    assert m["decode_tokens_per_s"] == pytest.approx(m["decode_tokens"] / m["decode_s"])
    assert 0 < m["ttft_per_request_s"][0] < m["ttft_per_request_s"][1] < m["ttft_per_request_s"][2]
    assert sum(m["wall_split_s"].values()) == pytest.approx(m["total_s"])


@pytest.mark.model
@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 4, "prefill_mode": "flash"}, "prefill mode"),
    ({"max_new_tokens": 8190}, "context"),
])
def test_bad_input_is_one_clear_error(smollm, mixed_prompts, kwargs, message):
    with pytest.raises(UserError, match=message):
        Engine(smollm, make_policy("full")).generate(mixed_prompts, **kwargs)


@pytest.mark.model
def test_plain_forward_outside_the_engine_still_works(smollm, mixed_prompts):
    """The registered attention falls back to SDPA when no policy is active (e.g. a user's own forward call)."""
    ids = torch.tensor([mixed_prompts[0]])
    with torch.no_grad():
        logits = smollm.model(ids).logits
    assert int(logits[0, -1].argmax()) == hf_greedy(smollm, mixed_prompts[0], 1)[0]


@pytest.mark.parametrize("name", available())
def test_every_policy_records_an_oom_instead_of_crashing(tiny, name):
    prompts = [list(range(100, 160)), list(range(200, 230))]
    mode = make_policy(name).preferred_prefill
    tight = Engine(tiny, make_policy(name), device_capacity_bytes=tiny.weights_bytes + tiny.packed_copy_bytes + 64 * 1024)
    result = tight.generate(prompts, 4, prefill_mode=mode)
    assert result.oom is not None and result.oom["capacity_bytes"] == tiny.weights_bytes + tiny.packed_copy_bytes + 64 * 1024
    roomy = Engine(tiny, make_policy(name), device_capacity_bytes=tiny.weights_bytes + tiny.packed_copy_bytes + 64 * 2**20)
    assert roomy.generate(prompts, 4, prefill_mode=mode).oom is None


@pytest.mark.parametrize("name", available())
def test_every_run_records_its_policys_mechanism_in_the_posters_words(tiny, name):
    """kvlib.report.findings.systems tabulates these from the rows: each is said, and what a lossless policy says of itself
    agrees with it (every entry kept and read, nothing evicted, at the model's bits unless it quantizes)."""
    policy = make_policy(name)
    stats = Engine(tiny, policy).generate([list(range(100, 140))], 3, prefill_mode=policy.preferred_prefill).stats
    assert all(isinstance(stats[k], str) and stats[k] for k in ("keeps", "reads", "evicts", "granularity"))
    assert stats["kv_bits"] in (2, 4, 8, 16, 32)
    assert stats["batching"] == BATCHING["static"]
    if policy.lossless:
        assert (stats["keeps"], stats["reads"], stats["evicts"], stats["kv_bits"]) == \
            ("every entry", "all it keeps", "nothing", 8 * tiny.spec.dtype_bytes)
    if name == "kivi":
        assert stats["kv_bits"] == policy.bits


@pytest.mark.parametrize("name", available())
def test_every_run_measures_the_device_kv_it_held_per_token_seen(tiny, name):
    """KVUsage, booked by the session after each decode step for every policy alike: the full cache holds the model's
    bytes per token exactly, a lossless policy at least as much (blocks round a row's entries up), and none more
    than its blocks' rounding above the full cache."""
    policy = make_policy(name)
    prompts = [list(range(100, 180)), list(range(300, 340))]
    stats = Engine(tiny, policy).generate(prompts, 5, prefill_mode=policy.preferred_prefill, stop_at_eos=False).stats
    held, dense = stats["kv_device_bytes_per_token"], tiny.spec.kv_bytes_per_token
    steps = 4  # the last token is never fed back
    assert stats["kv_tokens_held_total"] == sum(len(p) + 1 + s for p in prompts for s in range(steps))
    if name == "full":
        assert held == dense
    if policy.lossless:
        assert held >= dense
    assert 0 <= held <= 1.25 * dense
    bare = Engine(tiny, make_policy(name), instrumented=False).generate(prompts, 3, stop_at_eos=False,
                                                                        prefill_mode=policy.preferred_prefill)
    assert bare.stats["kv_device_bytes_per_token"] is None  # a run that books nothing says nothing held


def test_teacher_forcing_scores_continuations_like_one_full_forward(tiny):
    torch.manual_seed(3)
    prompts = [torch.randint(100, 5000, (n,)).tolist() for n in (12, 7)]
    continuations = [torch.randint(100, 5000, (n,)).tolist() for n in (5, 3)]
    result = Engine(tiny, make_policy("full")).generate(prompts, 1, forced=continuations)
    for prompt, cont, out in zip(prompts, continuations, result.outputs):
        assert out["token_ids"] == cont
        with torch.no_grad():
            logits = tiny.model(torch.tensor([prompt + cont])).logits[0].float()
        reference = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)[torch.arange(len(cont)), cont]
        assert torch.allclose(torch.tensor(out["logprobs"]), reference, atol=1e-4)


def test_teacher_forced_scores_change_under_a_small_budget(tiny):
    torch.manual_seed(4)
    prompt = [torch.randint(100, 5000, (80,)).tolist()]
    cont = [torch.randint(100, 5000, (6,)).tolist()]
    full = Engine(tiny, make_policy("full")).generate(prompt, 1, forced=cont).outputs[0]["logprobs"]
    for name in ("h2o", "infinigen"):
        policy = make_policy(name, budget=1.0, **({"alpha": 1e9} if name == "infinigen" else {}))
        same = Engine(tiny, policy).generate(prompt, 1, prefill_mode=policy.preferred_prefill, forced=cont)
        assert same.outputs[0]["logprobs"] == pytest.approx(full, abs=1e-4)
        sparse = Engine(tiny, make_policy(name, budget=0.1)).generate(prompt, 1, prefill_mode=policy.preferred_prefill,
                                                                       forced=cont)
        assert max(abs(a - b) for a, b in zip(sparse.outputs[0]["logprobs"], full)) > 1e-3


@pytest.mark.parametrize("name", ["full", "paged", "h2o", "infinigen"])
def test_identical_prompts_fork_instead_of_prefilling_again(tiny, name):
    """The answer choices of one question share their context: forked rows score exactly as prefilled ones."""
    torch.manual_seed(5)
    context = torch.randint(100, 5000, (40,)).tolist()
    other = torch.randint(100, 5000, (30,)).tolist()
    prompts = [context, context, other, context]
    forced = [torch.randint(100, 5000, (n,)).tolist() for n in (3, 5, 4, 2)]
    runs = []
    for share in (False, True):
        policy = make_policy(name, **({"budget": 0.5} if name in ("h2o", "infinigen") else {}))
        runs.append(Engine(tiny, policy).generate(prompts, 1, prefill_mode=policy.preferred_prefill, forced=forced,
                                                  share_prompts=share))
    for plain, shared in zip(runs[0].outputs, runs[1].outputs):
        assert shared["logprobs"] == pytest.approx(plain["logprobs"], abs=1e-5)
        assert shared["greedy"] == plain["greedy"]


@pytest.mark.parametrize("mode", ["fused", "chunked"])
def test_a_prefill_whose_logits_nobody_reads_skips_the_lm_head(smollm, mode):
    """A chunk before a prompt's last, or a turn prefilled with logits=False, runs no LM head (kvlib's forward pass;
    transformers' computes them and they are dropped); the next step's logits are the same as when they were read."""
    prompt = smollm.tokenizer.encode("Once upon a time, in a land far away, there lived a dragon who guarded gold")
    calls = []
    hook = smollm.model.lm_head.register_forward_hook(lambda *_: calls.append(1))
    try:
        nexts = {}
        for read in (True, False):
            engine = Engine(smollm, make_policy("full"))
            with engine.session([len(prompt) + 2], 2) as session:
                calls.clear()
                out = session.prefill(0, prompt, mode, chunk_size=8, logits=read)
                assert (out is not None) == read and len(calls) == int(read)  # chunked: never the earlier chunks'
                nexts[read] = session.decode([0], [prompt[-1]])
        torch.testing.assert_close(nexts[True], nexts[False], rtol=0, atol=0)
    finally:
        hook.remove()
