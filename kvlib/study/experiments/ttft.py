"""TTFT vs prompt length per policy and prefill mode (paper Fig. 1, 2), with OOM points under a device capacity."""

from kvlib.models.workloads import prompt_of_length
from kvlib.report import ttft as chapter
from kvlib.report.pages import TIMING
from kvlib.study.checks import positive_int
from kvlib.study.experiment import Experiment, register
from kvlib.study.experiments.common import model_of, run_timed


def run_point(point, kept) -> list[dict]:
    v = point.values
    prompt = prompt_of_length(model_of(point, kept).tokenizer, v["prompt_tokens"], source=v.get("text_source"))
    return [run_timed(point, kept, [prompt], max_new_tokens=v.get("max_new_tokens", 1))]


EXPERIMENT = register(Experiment(
    "ttft", "Time to first token", run_point, timed=True, systems=True, short="TTFT",
    workload={"prompt_tokens": positive_int, "max_new_tokens": positive_int},
    required=("prompt_tokens",),
    lead=chapter.lead, findings=(1,), error_rate=TIMING.statement()))
