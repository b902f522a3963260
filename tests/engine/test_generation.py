"""Answers for several rows at once (lm-eval's generate_until, retention in lockstep) equal the answers one at a time;
the strict protocol feeds the prompt's last token through a decode step."""

from types import SimpleNamespace

import pytest

from kvlib.engine import Engine
from kvlib.errors import UserError
from kvlib.evaluation import KVLibLM, retention
from kvlib.evaluation.generation import split_prompt
from kvlib.policies import make_policy

SETTINGS = {"full": {}, "h2o": {"budget": 0.3}, "infinigen": {"budget": 0.3}, "streaming": {"budget": 0.3}}
TEXTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away, there lived a",
         "Numbers: 1, 2, 3,", "import os\nimport sys\n", "The quick brown fox"]


def requests(max_gen_toks=6, until=("\n\n",)):
    return [SimpleNamespace(args=(text, {"until": list(until), "max_gen_toks": max_gen_toks})) for text in TEXTS]


def lm(tiny, name, batch_size, protocol="deployed"):
    return KVLibLM(policy=name, loaded=tiny, batch_size=batch_size, protocol=protocol, **SETTINGS[name])


@pytest.mark.parametrize("protocol", ["deployed", "strict"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_batched_generate_until_answers_as_one_at_a_time(tiny, name, protocol):
    alone = lm(tiny, name, 1, protocol).generate_until(requests(), disable_tqdm=True)
    together = lm(tiny, name, 4, protocol).generate_until(requests(), disable_tqdm=True)
    assert together == alone and any(alone)


def test_deployed_answers_as_the_engine_generates(tiny):
    """Deployed is what Engine.generate (the scheduler's static schedule) does for one prompt."""
    model = lm(tiny, "h2o", 3)
    ours = model.generate_until(requests(until=()), disable_tqdm=True)
    for text, answer in zip(TEXTS, ours):
        policy = make_policy("h2o", budget=0.3)
        out = Engine(tiny, policy).generate([tiny.tokenizer.encode(text)], 6, prefill_mode=policy.preferred_prefill)
        assert out.outputs[0]["text"] == answer


def test_strict_feeds_the_last_prompt_token_through_a_decode_step(tiny):
    assert split_prompt([1, 2, 3], "strict") == ([1, 2], [3]) and split_prompt([1, 2, 3], "deployed") == ([1, 2, 3], [])
    assert split_prompt([7], "strict") == ([7], [])  # nothing left to prefill: the prefill answers
    with pytest.raises(UserError, match="unknown protocol"):
        split_prompt([1], "lenient")
    seen = {}
    for protocol in ("deployed", "strict"):
        model = lm(tiny, "full", 4, protocol)
        answers = model.generate_until(requests(max_gen_toks=4, until=()), disable_tqdm=True)
        seen[protocol] = (answers, model.tokens_seen)
    # the full cache answers alike either way; strict runs one decode step more per request, over its whole prompt
    assert seen["strict"][0] == seen["deployed"][0]
    assert seen["strict"][1] > seen["deployed"][1]


@pytest.fixture(scope="module")
def conversations(smollm):
    return retention.offline_conversations(smollm.tokenizer, [[300, 500]], per_bucket=3, turns=4, seed=5)


@pytest.mark.parametrize("protocol", ["deployed", "strict"])
@pytest.mark.parametrize("name", ["full", "h2o", "infinigen"])
def test_conversations_in_lockstep_answer_as_each_alone(tiny, conversations, name, protocol):
    def engine():
        return Engine(tiny, make_policy(name, **SETTINGS[name]))

    keep = ("conversation", "turn", "answer", "correct", "context_tokens", "protocol")
    alone = [{k: r[k] for k in keep} for conv in conversations
             for r in retention.run_conversation(engine(), conv, [2, 4], "chunked", 64, answer_tokens=5,
                                                 protocol=protocol)]
    together = [{k: r[k] for k in keep} for r in retention.run_conversations(
        engine(), conversations, [2, 4], "chunked", 64, answer_tokens=5, protocol=protocol)]
    assert sorted(together, key=str) == sorted(alone, key=str) and len(alone) == 6


@pytest.mark.parametrize("name", ["full", "h2o", "infinigen"])
def test_protocols_in_one_pass_answer_as_each_protocol_alone(tiny, conversations, name):
    """Retention runs both protocols over one feed of each conversation: every answer is the one its protocol's own
    pass gives."""
    def engine():
        return Engine(tiny, make_policy(name, **SETTINGS[name]))

    keep = ("conversation", "turn", "answer", "correct", "context_tokens", "protocol")
    alone = [{k: r[k] for k in keep} for protocol in ("deployed", "strict")
             for r in retention.run_conversations(engine(), conversations, [2, 4], "chunked", 64, answer_tokens=5,
                                                  protocol=protocol)]
    joint = [{k: r[k] for k in keep} for r in retention.run_conversations(
        engine(), conversations, [2, 4], "chunked", 64, answer_tokens=5, protocol=["deployed", "strict"])]
    assert sorted(joint, key=str) == sorted(alone, key=str) and len(joint) == 12


def test_rows_under_both_protocols_share_their_decode_steps(tiny):
    """answer_rows with each row's own protocol: the answers are each protocol's alone, in the decode steps of one
    protocol's answering (a strict row's prompt token fed beside a deployed row's first answer token)."""
    from kvlib.evaluation.generation import answer_rows

    prompts = [tiny.tokenizer.encode(t) for t in TEXTS[:3]]
    engine = Engine(tiny, make_policy("h2o", budget=0.3))

    def answer(protocols):
        steps = []
        with engine.session([len(p) + 6 for p in prompts] * 2, 6) as session:
            decode = session.decode
            session.decode = lambda rows, tokens: steps.append(len(rows)) or decode(rows, tokens)
            answers = answer_rows(session, list(range(len(protocols))), prompts * (len(protocols) // 3), 6,
                                  protocols, "chunked")
        return answers, steps

    deployed, deployed_steps = answer(["deployed"] * 3)
    strict, strict_steps = answer(["strict"] * 3)
    joint, joint_steps = answer(["deployed"] * 3 + ["strict"] * 3)
    assert joint == deployed + strict
    assert len(joint_steps) == max(len(deployed_steps), len(strict_steps)) < len(deployed_steps) + len(strict_steps)
    with pytest.raises(ValueError, match="2 protocols for 3 rows"):
        answer_rows(None, [0, 1, 2], prompts, 6, ["strict", "deployed"], "chunked")
