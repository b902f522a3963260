"""Memory, throughput and latency vs batch size on mixed-length prompts (paper Fig. 3, 4, 5)."""

from kvlib.models.workloads import mixed_length_prompts
from kvlib.report import batch_scaling as chapter
from kvlib.report.pages import TIMING
from kvlib.study.checks import positive_int
from kvlib.study.experiment import Experiment, register
from kvlib.study.experiments.common import model_of, run_timed


def run_point(point, kept) -> list[dict]:
    v = point.values
    prompts = mixed_length_prompts(model_of(point, kept).tokenizer, v["batch_size"], v["min_prompt_tokens"],
                                   v["max_prompt_tokens"], seed=v.get("seed", 0), source=v.get("text_source"))
    row = run_timed(point, kept, prompts, v["max_new_tokens"])
    row["prompt_tokens_total"] = sum(map(len, prompts))
    return [row]


EXPERIMENT = register(Experiment(
    "batch_scaling", "Batch scaling", run_point, timed=True, systems=True,
    workload={"batch_size": positive_int, "min_prompt_tokens": positive_int,
              "max_prompt_tokens": positive_int, "max_new_tokens": positive_int},
    required=("batch_size", "min_prompt_tokens", "max_prompt_tokens", "max_new_tokens"),
    lead=chapter.lead, findings=(2, 3), error_rate=TIMING.statement()))
