"""The retention test: turn-by-turn conversations, questions branched off the cached conversation."""

import json

import pytest

from kvlib.engine import Engine
from kvlib.errors import UserError
from kvlib.evaluation import retention
from kvlib.policies import make_policy


@pytest.fixture(scope="module")
def conversation(smollm):
    return retention.offline_conversations(smollm.tokenizer, [[300, 500]], per_bucket=1, turns=4, seed=3)[0]


def from_scratch(loaded, conv, turn, answer_tokens):
    """Reference: the whole conversation up to `turn` plus the question, prefilled at once with the full cache."""
    tok = loaded.tokenizer
    chat = retention.messages(conv, turn) + [{"role": "user", "content": conv.fact.question + retention.ASK}]
    prompt = tok.encode(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)
    out = Engine(loaded, make_policy("full")).generate([prompt], answer_tokens).outputs[0]
    return out["text"]


@pytest.mark.parametrize("name", ["full", "paged", "h2o", "infinigen"])
def test_branched_questions_answer_as_if_the_conversation_were_recomputed(tiny, conversation, name):
    """At budget 1.0 every policy's branched answers equal a from-scratch run: forking and extending a row lose
    nothing, and the question never leaks into the conversation's own row."""
    settings = {"budget": 1.0} if name in ("h2o", "infinigen") else {}
    policy = make_policy(name, **settings)
    rows = retention.run_conversation(Engine(tiny, policy), conversation, [2, 4], policy.preferred_prefill,
                                      chunk_size=64, answer_tokens=5)
    assert [r["turn"] for r in rows] == [2, 4]
    for row in rows:
        assert row["answer"] == from_scratch(tiny, conversation, row["turn"], 5)
        assert row["expected"] == conversation.fact.answer and row["bucket"] == "300-500"


def test_eviction_carries_across_turns(tiny, conversation):
    """H2O at a small budget evicts for good: its answers differ from the full cache's somewhere."""
    answers = {}
    for name, settings in (("full", {}), ("h2o", {"budget": 0.1})):
        policy = make_policy(name, **settings)
        rows = retention.run_conversation(Engine(tiny, policy), conversation, [1, 2, 3, 4], policy.preferred_prefill,
                                          chunk_size=64, answer_tokens=5)
        answers[name] = [r["answer"] for r in rows]
    assert answers["full"] != answers["h2o"]


def test_offline_conversations_fall_in_their_buckets_with_several_facts(smollm):
    convs = retention.offline_conversations(smollm.tokenizer, [[512, 1024], [1024, 2048]], per_bucket=3, seed=0)
    assert len({c.fact.answer for c in convs}) >= 5
    for conv in convs:
        lo, hi = conv.bucket
        assert lo * 0.8 <= retention.conversation_tokens(smollm.tokenizer, conv) < hi * 1.1
        assert len(conv.exchanges) == 12


def lmsys_record(i, turns, language="English", words=60):
    conversation = []
    for t in range(turns):
        conversation += [{"content": f"Question {t} of chat {i}: " + "tell me more " * words, "role": "user"},
                         {"content": f"Answer {t}: " + "here is more " * words, "role": "assistant"}]
    return {"conversation_id": f"c{i}", "model": "vicuna-13b", "conversation": conversation, "turn": turns,
            "language": language, "openai_moderation": [], "redacted": False}


def test_a_local_stand_in_shaped_like_lmsys_chat_1m(smollm, tiny, tmp_path):
    """The paper profile streams lmsys/lmsys-chat-1m; the same code reads a local file with its record layout."""
    records = [lmsys_record(0, 1), lmsys_record(1, 4), lmsys_record(2, 4, language="Portuguese"),
               lmsys_record(3, 6), lmsys_record(4, 3, words=10)]
    path = tmp_path / "lmsys.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    source = {"kind": "hf", "path": "json", "data_files": str(path), "field": "conversation"}
    convs = retention.dataset_conversations(smollm.tokenizer, source, [[100, 500], [500, 4000]], per_bucket=2,
                                            min_turns=2)
    assert sorted(c.id for c in convs) == ["c1", "c3", "c4"]  # c0 too short, c2 not English
    assert {c.bucket for c in convs} == {(100, 500), (500, 4000)}
    short = next(c for c in convs if c.bucket == (100, 500))  # the tiny test model has a 1K context
    policy = make_policy("h2o", budget=0.3)
    rows = retention.run_conversation(Engine(tiny, policy), short, [2, 4, 6], "chunked", answer_tokens=3)
    assert [r["turn"] for r in rows] == [t for t in (2, 4, 6) if t <= len(short.exchanges)]


def test_an_unreachable_dataset_is_one_clear_error(smollm, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="lmsys/lmsys-chat-1m.*hub"):
        retention.dataset_conversations(smollm.tokenizer, {"kind": "hf", "path": "lmsys/lmsys-chat-1m",
                                                           "field": "conversation"}, [[1024, 2048]], 1)
