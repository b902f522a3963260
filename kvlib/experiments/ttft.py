"""TTFT vs prompt length per policy and prefill mode (paper Fig. 1, 2), with OOM points under a device capacity."""

from kvlib.experiments.common import model_of, result_row, run
from kvlib.workloads import prompt_of_length


def run_point(point: dict) -> list[dict]:
    tokenizer = model_of(point).tokenizer
    prompt = prompt_of_length(tokenizer, point["prompt_tokens"], source=point.get("text_source"))
    result = run(point, [prompt], max_new_tokens=point.get("max_new_tokens", 1), prefill=point["prefill"],
                 chunk_size=point.get("chunk_size", 512))
    return [result_row(result, point)]
