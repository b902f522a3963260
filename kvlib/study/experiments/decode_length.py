"""Decode throughput and wall-time split vs output length at a fixed long input (paper Fig. 6)."""

from kvlib.models.workloads import prompt_of_length
from kvlib.report import decode_length as chapter
from kvlib.report.pages import TIMING
from kvlib.study.checks import positive_int
from kvlib.study.experiment import Experiment, register
from kvlib.study.experiments.common import model_of, run_timed


def run_point(point, kept) -> list[dict]:
    v = point.values
    prompts = [prompt_of_length(model_of(point, kept).tokenizer, v["prompt_tokens"], offset=1000 * i,
                                source=v.get("text_source")) for i in range(v.get("batch_size", 1))]
    return [run_timed(point, kept, prompts, v["output_tokens"])]


EXPERIMENT = register(Experiment(
    "decode_length", "Decode length", run_point, timed=True, systems=True,
    workload={"output_tokens": positive_int, "prompt_tokens": positive_int, "batch_size": positive_int},
    required=("output_tokens", "prompt_tokens"),
    lead=chapter.lead, error_rate=TIMING.statement()))
