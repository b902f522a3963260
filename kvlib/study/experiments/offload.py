"""Offloading, FlexGen's memory hierarchy: decode throughput and bytes read off the disk per generated token as the
share of the KV cache (and of the weights) on disk grows, beside the disk's own read rate; and, at a device capacity
the full cache runs out of, what an offloaded runner still completes, with its memory per tier."""

from kvlib.memory.disk import read_bandwidth
from kvlib.models.workloads import prompt_of_length
from kvlib.policies.flexgen import default_offload_dir
from kvlib.report import offload as chapter
from kvlib.report.pages import TIMING
from kvlib.study.checks import positive_int
from kvlib.study.experiment import Experiment, register
from kvlib.study.experiments.common import model_of, run_timed

PROBE_BYTES, PROBE_CHUNK = 128 * 2**20, 8 * 2**20  # the disk's read rate: a file of 128 MiB read in 8 MiB chunks


def run_point(point, kept) -> list[dict]:
    v = point.values
    prompts = [prompt_of_length(model_of(point, kept).tokenizer, v["prompt_tokens"], offset=1000 * i,
                                source=v.get("text_source")) for i in range(v["batch_size"])]
    row = run_timed(point, kept, prompts, v["max_new_tokens"])
    root = point.settings.get("offload_dir") or default_offload_dir()
    # measured once a process and offload folder, beside the first point there
    probe = kept.get(("disk read rate", root), lambda: read_bandwidth(root, PROBE_BYTES, PROBE_CHUNK))
    return [{**row, "disk_read_bytes_per_s": probe["read_bytes_per_s"],
             "disk_probe_page_cache_bytes": probe["read_bytes_page_cache"], "disk_probe_bytes": probe["bytes"]}]


EXPERIMENT = register(Experiment(
    "offload", "Offloading: FlexGen's memory hierarchy", run_point, timed=True,
    workload={"batch_size": positive_int, "prompt_tokens": positive_int, "max_new_tokens": positive_int},
    required=("batch_size", "prompt_tokens", "max_new_tokens"),
    lead=chapter.lead, error_rate=TIMING.statement()))
