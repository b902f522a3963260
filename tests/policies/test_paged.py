"""The paged policy in the engine and under continuous batching."""

import pytest
import torch

from kvlib.engine import Engine
from kvlib.engine.scheduler import RunSettings, Sequence
from kvlib.errors import UserError
from kvlib.models.workloads import mixed_length_prompts, prompt_of_length
from kvlib.policies import make_policy


def tokens(result):
    return [o["token_ids"] for o in result.outputs]


@pytest.mark.model
@pytest.mark.parametrize("mode", ["full", "fused", "chunked"])
def test_paged_equals_full_for_a_mixed_batch(smollm, mixed_prompts, mode):
    full = Engine(smollm, make_policy("full")).generate(mixed_prompts, 16)
    paged = Engine(smollm, make_policy("paged", block_size=4)).generate(mixed_prompts, 16, prefill_mode=mode,
                                                                        chunk_size=5)
    assert tokens(paged) == tokens(full)


@pytest.mark.model
def test_requests_arriving_at_different_steps(smollm):
    prompts = mixed_length_prompts(smollm.tokenizer, 4, 20, 60, seed=3)
    full = Engine(smollm, make_policy("full")).generate(prompts, 10, stop_at_eos=False)
    requests = [Sequence(p, 10, arrival_step=3 * i) for i, p in enumerate(prompts)]
    served = Engine(smollm, make_policy("paged", block_size=4)).run(requests, RunSettings("continuous", "chunked",
                                                                    chunk_size=16, stop_at_eos=False))
    assert tokens(served) == tokens(full)
    assert served.metrics["preemptions"] == 0


@pytest.mark.model
def test_shared_prefix_uses_one_prefix_of_blocks(smollm):
    prefix = prompt_of_length(smollm.tokenizer, 1024)
    prompts = [prefix + smollm.tokenizer(f" Question {i}: what is")["input_ids"] for i in range(4)]
    alone = [tokens(Engine(smollm, make_policy("full")).generate([p], 6))[0] for p in prompts]
    result = Engine(smollm, make_policy("paged")).generate(prompts, 6)
    assert tokens(result) == alone
    per_request = -(-(len(prompts[0]) + 6) // 16)
    assert result.stats["peak_blocks_used"] <= 1024 // 16 + 4 * (per_request - 1024 // 16)
    assert result.stats["prefix_hit_rate"] == pytest.approx(3 * 1024 / sum(map(len, prompts)), abs=0.01)


def test_preemption_completes_a_workload_larger_than_the_pool(tiny):
    torch.manual_seed(0)
    # the three prompts fit the 30 x 4-token pool (29 blocks); their growing outputs do not
    prompts = [torch.randint(100, 5000, (n,)).tolist() for n in (40, 40, 36)]
    expected = tokens(Engine(tiny, make_policy("full")).generate(prompts, 30, stop_at_eos=False))
    requests = [Sequence(p, 30) for p in prompts]
    settings = RunSettings("continuous", "chunked", chunk_size=16, stop_at_eos=False)
    served = Engine(tiny, make_policy("paged", block_size=4, num_blocks=30)).run(requests, settings)
    assert tokens(served) == expected
    assert served.metrics["preemptions"] > 0


def test_fork_diverges_without_corrupting_the_parent(tiny):
    policy = make_policy("paged", block_size=4)
    engine = Engine(tiny, policy)
    prompt = list(range(100, 110))  # 10 tokens: the third block is shared half full after the fork
    with engine.session([10, 10], 4) as session:
        session.prefill(0, prompt, "fused")
        session.fork(0, 1)
        parent_block = policy.tables[0].blocks[2]

        def block(b):
            return policy.kv.keys[:, :, 4 * b:4 * (b + 1)]
        snapshot = block(parent_block).clone()
        session.decode([1], [7])
        assert policy.tables[1].blocks[:2] == policy.tables[0].blocks[:2]
        assert policy.tables[1].blocks[2] != parent_block
        assert torch.equal(block(parent_block), snapshot)  # the parent's block is untouched
        child_block = policy.tables[1].blocks[2]
        assert torch.equal(block(child_block)[:, :, :2], snapshot[:, :, :2])  # shared tokens were copied


@pytest.mark.parametrize("settings, message", [
    ({"block_size": 0}, "block_size"), ({"block_size": 12}, "power of two"), ({"num_blocks": 0}, "num_blocks"),
])
def test_bad_settings(settings, message):
    with pytest.raises(UserError, match=message):
        make_policy("paged", **settings)


def test_pool_too_small_for_one_request(tiny):
    with pytest.raises(UserError, match="cannot hold even one request"):
        Engine(tiny, make_policy("paged", block_size=4, num_blocks=2)).generate([list(range(100, 120))], 2)


def test_continuous_batching_needs_a_policy_that_releases_rows(tiny):
    from kvlib.policies.base import KVPolicy
    from kvlib.policies.full import FullPolicy

    class Unreleasing(FullPolicy):  # a policy added without release(), as README's example could be
        release = KVPolicy.release

    with pytest.raises(UserError, match="continuous batching needs"):
        Engine(tiny, Unreleasing()).run([Sequence(list(range(100, 120)), 2)], RunSettings("continuous", "chunked"))
