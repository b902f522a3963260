"""Decode throughput and wall-time split vs output length at a fixed long input (paper Fig. 6)."""

from kvlib.experiments.common import model_of, result_row, run
from kvlib.workloads import prompt_of_length


def run_point(point: dict) -> list[dict]:
    tokenizer = model_of(point).tokenizer
    prompts = [prompt_of_length(tokenizer, point["prompt_tokens"], offset=1000 * i, source=point.get("text_source"))
               for i in range(point.get("batch_size", 1))]
    result = run(point, prompts, point["output_tokens"], prefill=point.get("prefill"),
                 chunk_size=point.get("chunk_size", 512))
    return [result_row(result, point)]
