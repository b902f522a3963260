"""Retention of an early fact across context-length buckets and turns (paper Fig. 8): one row per question."""

from kvlib.evaluation.retention import dataset_conversations, offline_conversations, run_conversation
from kvlib.experiments.common import make_engine, weights_of
from kvlib.random_weights import check_experiment


def run_point(point: dict) -> list[dict]:
    check_experiment("retention", weights_of(point))
    engine = make_engine(point)
    tokenizer = engine.model.tokenizer
    turns = point["query_turns"]
    if point.get("conversations"):
        convs = dataset_conversations(tokenizer, point["conversations"], point["buckets"], point["per_bucket"],
                                      min_turns=min(turns), max_turns=max(turns), seed=point.get("seed", 0))
    else:
        convs = offline_conversations(tokenizer, point["buckets"], point["per_bucket"], turns=max(turns),
                                      seed=point.get("seed", 0))
    rows = []
    for conv in convs:
        rows += run_conversation(engine, conv, turns, engine.policy.preferred_prefill,
                                 chunk_size=point.get("chunk_size", 512), answer_tokens=point.get("answer_tokens", 12))
    return rows
