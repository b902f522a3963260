"""Memory, throughput and latency vs batch size on mixed-length prompts (paper Fig. 3, 4, 5)."""

from kvlib.experiments.common import model_of, result_row, run
from kvlib.workloads import mixed_length_prompts


def run_point(point: dict) -> list[dict]:
    tokenizer = model_of(point).tokenizer
    prompts = mixed_length_prompts(tokenizer, point["batch_size"], point["min_prompt_tokens"],
                                   point["max_prompt_tokens"], seed=point.get("seed", 0),
                                   source=point.get("text_source"))
    result = run(point, prompts, point["max_new_tokens"], prefill=point.get("prefill"),
                 chunk_size=point.get("chunk_size", 512))
    row = result_row(result, point)
    row["prompt_tokens_total"] = sum(map(len, prompts))
    return [row]
