"""Decode throughput and wall-time split vs output length at a fixed long input (paper Fig. 6)."""

from kvlib.models.workloads import prompt_of_length
from kvlib.study.experiments.common import model_of, run_timed

TIMED = True  # what it measures is time: a run disturbed by other processes is measured again


def run_point(point) -> list[dict]:
    v = point.values
    prompts = [prompt_of_length(model_of(point).tokenizer, v["prompt_tokens"], offset=1000 * i,
                                source=v.get("text_source")) for i in range(v.get("batch_size", 1))]
    return [run_timed(point, prompts, v["output_tokens"])]
