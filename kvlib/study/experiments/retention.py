"""Retention of an early fact across context-length buckets and turns (paper Fig. 8): one row per question."""

from kvlib.evaluation.retention import dataset_conversations, offline_conversations, run_conversation
from kvlib.study.experiments.common import make_engine


def run_point(point) -> list[dict]:
    v = point.values
    engine = make_engine(point)
    tokenizer = engine.model.tokenizer
    turns = v["query_turns"]
    if v.get("conversations"):
        convs = dataset_conversations(tokenizer, v["conversations"], v["buckets"], v["per_bucket"],
                                      min_turns=min(turns), max_turns=max(turns), seed=v.get("seed", 0))
    else:
        convs = offline_conversations(tokenizer, v["buckets"], v["per_bucket"], turns=max(turns),
                                      seed=v.get("seed", 0))
    rows = []
    for conv in convs:
        rows += run_conversation(engine, conv, turns, engine.policy.preferred_prefill,
                                 chunk_size=v.get("chunk_size", 512), answer_tokens=v.get("answer_tokens"))
    return rows
