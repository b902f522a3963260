"""Retention of an early fact across context-length buckets and turns (paper Fig. 8): one row per question."""

from kvlib.evaluation.retention import dataset_conversations, offline_conversations, run_conversations
from kvlib.report import retention as chapter
from kvlib.report.pages import FINDINGS
from kvlib.settings import DECODED
from kvlib.study.checks import bucket, list_of, one_of, one_or_list, optional, positive_int, source
from kvlib.study.experiment import Experiment, register
from kvlib.study.experiments.common import make_engine


def run_point(point, kept) -> list[dict]:
    v = point.values
    engine = make_engine(point, kept)
    tokenizer = engine.model.tokenizer
    turns = v["query_turns"]
    if v.get("conversations"):
        convs = dataset_conversations(tokenizer, v["conversations"], v["buckets"], v["per_bucket"],
                                      min_turns=min(turns), max_turns=max(turns), seed=v.get("seed", 0))
    else:
        convs = offline_conversations(tokenizer, v["buckets"], v["per_bucket"], turns=max(turns),
                                      seed=v.get("seed", 0))
    # conversations in lockstep groups (their answers decode together), in bucket order so a group's lengths are near
    size = v.get("lockstep", 1)
    rows = []
    for begin in range(0, len(convs), size):
        rows += run_conversations(engine, convs[begin:begin + size], turns, engine.policy.preferred_prefill,
                                  chunk_size=v.get("chunk_size", 512), answer_tokens=v.get("answer_tokens"),
                                  protocol=v.get("protocol", "deployed"))
    return rows


def sizes(name: str, retention: dict) -> list[str]:
    """The methods page's row of a profile's retention grid (kvlib.study.methods_figures.sizes)."""
    fixed, budgets = retention["fixed"], ", ".join(f"{b:g}" for b in retention["grid"]["budget"])
    if retention["grid"].get("budget_rule"):
        budgets += f" (H2O's budget rule: {', '.join(retention['grid']['budget_rule'])})"
    buckets = fixed["buckets"]
    protocols = fixed.get("protocol", "deployed")
    return [f"| `{name}` | retention | {', '.join(retention['policies'])} | {budgets} | "
            f"{len(buckets) * fixed['per_bucket']} conversations a policy ({fixed['per_bucket']} in each "
            f"of {len(buckets)} buckets: " + ", ".join(f"{lo:,}-{hi:,}" for lo, hi in buckets)
            + " tokens), questions after turns " + ", ".join(map(str, fixed["query_turns"]))
            + "; " + (", ".join(protocols) if isinstance(protocols, list) else protocols) + " |"]


EXPERIMENT = register(Experiment(
    "retention", "Retention of an early fact", run_point, timed=False, trained_only=True,
    workload={"query_turns": list_of(positive_int), "buckets": list_of(bucket), "per_bucket": positive_int,
              "conversations": optional(source), "lockstep": positive_int,
              "answer_tokens": optional(positive_int), "protocol": one_or_list(one_of(*DECODED))},
    required=("query_turns", "buckets", "per_bucket"),
    lead=chapter.lead, findings=(5,), sizes=sizes, error_rate=FINDINGS.borrowed("finding 5")))
