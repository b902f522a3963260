"""TTFT vs prompt length per policy and prefill mode (paper Fig. 1, 2), with OOM points under a device capacity."""

from kvlib.models.workloads import prompt_of_length
from kvlib.study.experiments.common import model_of, run_timed

TIMED = True  # what it measures is time: a run disturbed by other processes is measured again


def run_point(point) -> list[dict]:
    v = point.values
    prompt = prompt_of_length(model_of(point).tokenizer, v["prompt_tokens"], source=v.get("text_source"))
    return [run_timed(point, [prompt], max_new_tokens=v.get("max_new_tokens", 1))]
