"""Memory, throughput and latency vs batch size on mixed-length prompts (paper Fig. 3, 4, 5)."""

from kvlib.models.workloads import mixed_length_prompts
from kvlib.study.experiments.common import model_of, run_timed

TIMED = True  # what it measures is time: a run disturbed by other processes is measured again


def run_point(point) -> list[dict]:
    v = point.values
    prompts = mixed_length_prompts(model_of(point).tokenizer, v["batch_size"], v["min_prompt_tokens"],
                                   v["max_prompt_tokens"], seed=v.get("seed", 0), source=v.get("text_source"))
    row = run_timed(point, prompts, v["max_new_tokens"])
    row["prompt_tokens_total"] = sum(map(len, prompts))
    return [row]
