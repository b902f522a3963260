"""compress_h2o against the rules it takes from its sources (issue 53, items 12 and 14), restated here, not read from
kvlib:
- kvpress's DecodingPress (NVIDIA/kvpress@8bb29b9 kvpress/presses/decoding_press.py) compresses a cache to its target
  and never below it: `_find_target_compression_ratio` returns 0 (no compression) when the cache holds no more than
  the target. compress_h2o's target is a floor, `budget` x its prompt's tokens per KV head (as `tokens_allowed`
  counts a budget: round(budget x n), at least 1), and one compression keeps max(floor, round(share x held)).
- vLLM's scheduler (vllm-project/vllm@00024d3 vllm/v1/core/sched/scheduler.py) preempts a running request when one
  finds no free block (`self.running.pop()`), and a waiting request that finds none waits (`break`). compress_h2o
  compresses running requests so that they continue, and lets a waiting one wait (unless `compress_to_admit`).
- With `--prefill full`, the continuous schedule prefills each prompt whole at admission, as vLLM without chunked
  prefill, instead of ignoring the mode asked for.
"""

import pytest
from prompts import prompts_of

from kvlib.engine import Engine
from kvlib.engine.scheduler import RunSettings, Sequence
from kvlib.policies import make_policy

BUDGET = 0.3  # compress_h2o's floor by default: 0.3 of the prompt, the budget the serving chapter runs H2O at
SHARE = 0.25  # each compression keeps a quarter of what a request holds (down to its floor)


def floor_of(prompt_tokens: int, budget: float = BUDGET) -> int:
    """The official floor rule restated: the budget's share of the prompt, rounded, at least one entry."""
    return min(prompt_tokens, max(1, round(budget * prompt_tokens)))


def one_compression(held: int, floor: int, share: float = SHARE) -> int:
    """DecodingPress's rule with the floor as its target: nothing at or under it, else down to it at the least."""
    return held if held <= floor else max(floor, round(share * held))


def watch_held(policy, requests, low: dict):
    """After every pass and every compression, the fewest entries any KV head of a decoding request's row holds, read
    from the positions the policy keeps (its held entries), per request."""
    def read():
        for seq in requests:
            if seq.status == "running" and seq.row >= 0:
                fewest = min(len(kept) for layer in range(policy.spec.num_layers)
                             for kept in policy.kept_positions(layer, seq.row))
                low[seq.index] = min(low.get(seq.index, fewest), fewest)

    def after(method):
        def watched(*args):
            out = method(*args)
            read()
            return out
        return watched
    policy.after_pass, policy.compress = after(policy.after_pass), after(policy.compress)


def serve(tiny, requests, num_blocks, chunk_size=16, **settings):
    """The requests under the compress schedule, in a pool of num_blocks blocks of 4 tokens; and the fewest entries a
    head of each request held at any point."""
    policy = make_policy("compress_h2o", block_size=4, num_blocks=num_blocks, **settings)
    low: dict[int, int] = {}
    watch_held(policy, requests, low)
    result = Engine(tiny, policy).run(requests, RunSettings("compress", "chunked", chunk_size=chunk_size,
                                      stop_at_eos=False))
    return result, low


def test_its_defaults_are_a_floor_and_no_compression_to_admit():
    policy = make_policy("compress_h2o")
    assert policy.budget == BUDGET and policy.compress_to_admit is False and policy.compress_share == 0.5


def test_repeated_compression_never_takes_a_request_below_its_floor(tiny):
    """Two requests of 40 tokens that generate 90 each in a pool of 22 blocks of 4: each is compressed again and
    again, down to its floor (12 entries a head) and no further, and both are served in full."""
    prompts = prompts_of(40, 40)
    requests = [Sequence(p, 90) for p in prompts]
    result, low = serve(tiny, requests, 22, compress_share=SHARE)
    compressions = result.stats["compressions"]
    assert result.oom is None and [len(o["token_ids"]) for o in result.outputs] == [90, 90]
    assert len(compressions) > len(prompts)  # a request compressed more than once
    for c in compressions:
        floor = floor_of(len(prompts[c["request"]]))
        assert c["entries_after"] == one_compression(c["entries_before"], floor)
        assert c["entries_before"] > floor  # a request at its floor is not compressed
    assert any(c["entries_after"] == floor_of(40) for c in compressions)  # it reached the floor
    for index, prompt in enumerate(prompts):
        assert low[index] >= floor_of(len(prompt))  # never held fewer, at any step


def test_with_every_running_request_at_its_floor_it_preempts_as_paged_does(tiny):
    """At budget 1.0 the floor is the whole prompt: only what a request generated can go. Prompts of 43 and 44 tokens
    (each prefilled in one chunk) fill a pool of 22 blocks of 4 once the first has decoded a token; at the next step both need a block, each is
    compressed to its floor, which frees none, and the newest is preempted (vLLM's rule) and served later."""
    prompts = prompts_of(43, 44)
    result, low = serve(tiny, [Sequence(p, 20) for p in prompts], 22, chunk_size=64, budget=1.0, compress_share=SHARE)
    assert result.metrics["preemptions"] > 0 and [len(o["token_ids"]) for o in result.outputs] == [20, 20]
    assert all(c["entries_after"] == len(prompts[c["request"]]) for c in result.stats["compressions"])
    assert low == {0: 43, 1: 44}


def test_a_waiting_request_waits_instead_of_causing_a_compression(tiny):
    """A third request arrives when the pool, holding two running requests, has no room for its prompt: by default it
    waits (vLLM's rule), and no compression is made to admit it; `compress_to_admit` is the named setting that makes
    one. Compressions made so that a running request can continue are the only ones by default."""
    prompts = prompts_of(40, 40, 36)

    def requests():
        return [Sequence(p, 30, arrival_step=5 * (i == 2)) for i, p in enumerate(prompts)]
    waiting, _ = serve(tiny, requests(), 25)
    assert {c["needed_for"] for c in waiting.stats["compressions"]} <= {"decode"}
    assert [len(o["token_ids"]) for o in waiting.outputs] == [30, 30, 30]
    admitting, _ = serve(tiny, requests(), 25, compress_to_admit=True)
    assert "admission" in {c["needed_for"] for c in admitting.stats["compressions"]}


@pytest.mark.parametrize("schedule", ["continuous", "compress"])
def test_a_serving_schedule_prefills_whole_prompts_when_asked_to(tiny, schedule):
    """FlexGen + H2O scores a prompt in one pass (full prefill only): under the continuous schedule with prefill
    `full` each prompt is prefilled whole at admission, and with every request there at the start it decodes the
    tokens of the static schedule. compress_h2o under its own schedule likewise."""
    prompts = prompts_of(40, 25, 33)
    name, settings = ("flexgen_h2o", {"budget": 0.3}) if schedule == "continuous" else ("compress_h2o", {})
    static = Engine(tiny, make_policy(name, **settings)).generate(prompts, 8, prefill_mode="full", stop_at_eos=False)
    served = Engine(tiny, make_policy(name, **settings)).run([Sequence(p, 8) for p in prompts],
                                                             RunSettings(schedule, "full", stop_at_eos=False))
    assert [o["token_ids"] for o in served.outputs] == [o["token_ids"] for o in static.outputs]
    assert served.metrics["preemptions"] == 0
