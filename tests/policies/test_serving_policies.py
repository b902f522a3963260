"""Every policy that holds its cache in blocks serves under continuous batching: the same tokens as the static
schedule, the same tokens when preempted and recomputed, blocks back to the pool as it evicts, and a pool sized from
the device capacity by vLLM's rule."""

import pytest
from policy_examples import example, reserves_rows, whole_prompt
from prompts import prompts_of
from serving_cases import capacity_for

from kvlib.engine import Engine
from kvlib.engine.scheduler import BATCHING, RunSettings, Sequence
from kvlib.memory.paged_kv import serving_pool_bytes
from kvlib.policies import available, make_policy
from kvlib.policies.flexgen import ALL_ON_DEVICE


# each policy at its own examples (tests/policies/policy_examples.py): its small case, and a setting where it keeps
# everything
def keeping_all(name):
    """Its keeps-all example with blocks of 4, on the device alone (a cache split across tiers holds more rows in the
    same capacity: its device share)."""
    return example(name, "keeps_all", block_size=4, percent=ALL_ON_DEVICE)


def prefill_of(name):
    """How the schedules prefill a policy's prompts: whole at admission for one that prefills a prompt in one pass (as
    vLLM without chunked prefill), in chunks otherwise."""
    return "full" if whole_prompt(name) else "chunked"


def continuous(mode: str = "chunked") -> RunSettings:
    return RunSettings("continuous", mode, chunk_size=16, stop_at_eos=False)


def tokens(result):
    return [o["token_ids"] for o in result.outputs]


@pytest.mark.parametrize("name", available())
def test_continuous_with_every_request_at_the_start_gives_the_static_schedules_tokens(tiny, name):
    mode = prefill_of(name)
    prompts = prompts_of(40, 25, 33)
    static = Engine(tiny, make_policy(name, **example(name, block_size=4))).generate(prompts, 12, prefill_mode=mode,
                                                                        chunk_size=16, stop_at_eos=False)
    served = Engine(tiny, make_policy(name, **example(name, block_size=4))).run([Sequence(p, 12) for p in prompts],
                                                                                continuous(mode))
    assert tokens(served) == tokens(static)
    assert served.metrics["preemptions"] == 0
    assert (static.stats["batching"], served.stats["batching"]) == (BATCHING["static"], BATCHING["continuous"])


@pytest.mark.parametrize("name", available())
def test_a_capacity_too_small_for_every_request_gives_the_same_tokens(tiny, name):
    """A pool sized from a small device capacity (about 110 tokens) holds the prompts but not their growing outputs:
    requests are preempted, recomputed from their tokens, and end as they would have with room to spare. A policy
    that reserves whole rows holds fewer rows instead, and requests wait for one."""
    mode = prefill_of(name)
    prompts = prompts_of(40, 40, 36)
    roomy = Engine(tiny, make_policy(name, **keeping_all(name))).run([Sequence(p, 30) for p in prompts],
                                                                     continuous(mode))
    tight = Engine(tiny, make_policy(name, **keeping_all(name)), device_capacity_bytes=capacity_for(tiny, 110))
    tight = tight.run([Sequence(p, 30) for p in prompts], continuous(mode))
    assert tokens(tight) == tokens(roomy)
    assert roomy.metrics["preemptions"] == 0
    if reserves_rows(name):  # each row reserved whole: a request waits for a free row and is never preempted
        assert tight.metrics["max_running"] < 3 and tight.metrics["preemptions"] == 0
    else:
        assert tight.metrics["preemptions"] > 0


@pytest.mark.parametrize("name", ["h2o", "streaming", "snapkv"])
def test_an_evicting_policy_gives_its_prompts_blocks_back(tiny, name):
    """At budget 0.25 a 64-token prompt takes 16 blocks of 4 while it is prefilled, and keeps 4 once compacted."""
    policy = make_policy(name, **{**example(name, block_size=4), "budget": 0.25})
    engine = Engine(tiny, policy)
    with engine.session([64], 4) as session:
        session.prefill(0, prompts_of(64)[0], "chunked", chunk_size=32)
        assert policy.peak_blocks == 16
        assert policy.kv.pool.used == 4 and len(policy.kv.pool.free) == policy.kv.pool.num_blocks - 4
        session.release(0)
        assert policy.kv.pool.used == 0


@pytest.mark.parametrize("name", ["paged", "h2o", "quest"])
def test_a_serving_pool_is_what_the_capacity_leaves_after_the_weights(tiny, name):
    capacity = capacity_for(tiny, 400)
    policy = make_policy(name, **example(name, block_size=4))
    served = Engine(tiny, policy, device_capacity_bytes=capacity).run([Sequence(p, 4) for p in prompts_of(20, 30)],
                                                                      continuous())
    room = serving_pool_bytes(capacity, tiny.weights_bytes + tiny.packed_copy_bytes)
    held = served.memory["device"]["components"]
    assert 0.95 * room < held["kv"] + held["kv_reserved"] + held["overhead"] <= room + 1024  # + the block tables
    s = tiny.spec
    # a block's bytes beside its keys and values, per layer and KV head: H2O's scores and positions (4 + 8 bytes a
    # slot), Quest's key bounds (2 x head_dim floats)
    beside = {"paged": 0, "h2o": 4 * (4 + 8), "quest": 2 * s.head_dim * 4}[name]
    assert served.stats["num_blocks"] == room // (s.kv_bytes(4) + beside * s.num_layers * s.num_kv_heads)


def test_a_policy_reserving_whole_rows_serves_as_many_rows_as_the_capacity_holds(tiny):
    capacity = capacity_for(tiny, 200)
    policy = make_policy("full")
    prompts = prompts_of(40, 30, 20, 35, 25, 10)
    served = Engine(tiny, policy, device_capacity_bytes=capacity).run([Sequence(p, 10) for p in prompts],
                                                                      continuous())
    room = serving_pool_bytes(capacity, tiny.weights_bytes + tiny.packed_copy_bytes)
    assert policy.rows == room // tiny.spec.kv_bytes(40 + 10) == 4  # each row: the longest prompt + 10 tokens
    assert served.metrics["max_running"] <= policy.rows
