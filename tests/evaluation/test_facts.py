"""Fair scoring of the retention and recall facts: whole-word answers, an answer cap that fits, kinds balanced across
buckets and lengths, the recall fact at several depths."""

from collections import Counter

import pytest

from kvlib.evaluation import retention
from kvlib.evaluation.facts import KINDS, answer_cap, answered
from kvlib.evaluation.tasks import RECALL_DEPTHS, recall_design, recall_docs


@pytest.mark.parametrize("expected, answer", [
    ("fig", "My favourite fruit is the fig."), ("Fig", "FIG!"), ("Barkley", "Barkley's bowl is red."),
    ("Krakow", "She lives in Kraków."), ("4729", "The code is 4729"), ("Barkley", "barkley"),
])
def test_an_answer_stating_the_value_as_a_word_is_correct(expected, answer):
    assert answered(expected, answer)


@pytest.mark.parametrize("expected, answer", [
    ("fig", "Check the config file."), ("plum", "Call the plumbing service."), ("4729", "The code is 47291."),
    ("Oslo", ""), ("Lima", "I do not know."),
])
def test_a_value_inside_another_word_is_not_an_answer(expected, answer):
    assert not answered(expected, answer)


def test_the_answer_cap_fits_every_fact_stated_in_full(smollm):
    tok = smollm.tokenizer
    cap = answer_cap(tok, margin=0)
    statements = [template.format(v) for template, _, values in KINDS for v in values]
    assert cap == max(len(tok.encode(s, add_special_tokens=False)) for s in statements)
    assert answer_cap(tok) > cap  # and a margin for an opening word


def test_every_bucket_holds_the_same_kinds_of_fact(smollm):
    convs = retention.offline_conversations(smollm.tokenizer, [[300, 500], [500, 800], [800, 1200]], per_bucket=2,
                                            turns=2, seed=1)
    kinds = {}
    for conv in convs:
        kinds.setdefault(conv.bucket, []).append(conv.fact.question)
    assert len(set(map(tuple, kinds.values()))) == 1  # one bucket's kinds, in order, are every bucket's
    assert len(set(next(iter(kinds.values())))) == 2  # and within a bucket the kinds differ


def test_recall_meets_every_kind_at_every_depth_once_per_round():
    pairs = Counter(recall_design(i, len(KINDS), len(RECALL_DEPTHS)) for i in range(len(KINDS) * len(RECALL_DEPTHS)))
    combos = Counter((fact % len(KINDS), depth) for fact, depth in pairs)
    assert len(combos) == len(KINDS) * len(RECALL_DEPTHS) and set(combos.values()) == {1}


def test_recall_places_the_fact_at_its_depth_and_lengths_share_the_design(smollm):
    docs = recall_docs(smollm.tokenizer, [64, 128], items_per_length=6, choices=3, seed=0)
    by_length = {}
    for doc in docs:
        by_length.setdefault(doc["length"], []).append(doc)
        statement_at = doc["context"].index(next(t.split("{}")[0] for t, _, _ in KINDS
                                                 if t.split("{}")[0] in doc["context"]))
        share = statement_at / len(doc["context"])
        assert abs(share - doc["depth"]) < 0.25  # characters, not tokens: near its depth, not at the start
    depths = [[d["depth"] for d in docs] for docs in by_length.values()]
    assert depths[0] == depths[1] and len(set(depths[0])) == len(RECALL_DEPTHS)
    assert any(d["depth"] > 0 for d in docs) and not any(d["context"].startswith(t.split("{}")[0])
                                                         for d in docs for t, _, _ in KINDS)
