"""The serving experiment's tables, figures and sentences (kvlib.study.experiments.serving), pure functions of its
results frame.

**The sustained rate.** A runner sustains a request rate where at least `ATTAINMENT` (90 %) of the trace's requests
met every SLO limit there (`slo_attainment`: goodput / request throughput, the median over repeats), the run completed
and did not run out of memory. The highest rate a runner sustains is the highest *measured* rate at which it, and
every lower measured rate, pass: never a rate between or beyond grid points. Where it passes at the grid's highest
rate, the answer is "at least" that rate (its saturation lies beyond the grid); where it fails at the lowest, "below"
it.

**Compress instead of preempt** (issue 45). A runner that compresses a running request's cache where paged would
preempt it (`compress_h2o`, the scheduler's `compress` schedule) is read against `paged` on the same trace: its
preemptions, goodput and p99 TTFT, whom it compressed, and what that cost those requests: the share of their output
tokens equal to paged's, position by position (greedy decoding; a request it did not compress matches paged's at every
position, which the other requests' share checks).
"""

from kvlib.report.serving.compression import (
    COMPRESSION_COLUMNS,
    REFERENCE,
    agreement,
    compression_lines,
    compression_table,
    request_agreement,
    token_ids,
)
from kvlib.report.serving.figures import latency_vs_rate, memory_vs_rate, pool_mib
from kvlib.report.serving.frame import MIB
from kvlib.report.serving.page import lead, page_lines
from kvlib.report.serving.sentences import lines
from kvlib.report.serving.sustained import ATTAINMENT, Sustained, passes, sustained_rates
from kvlib.report.serving.tables import TABLE_COLUMNS, serving_table, serving_views, sustained_table, trace_table

__all__ = [
    "ATTAINMENT",
    "COMPRESSION_COLUMNS",
    "MIB",
    "REFERENCE",
    "TABLE_COLUMNS",
    "Sustained",
    "agreement",
    "compression_lines",
    "compression_table",
    "latency_vs_rate",
    "lead",
    "lines",
    "memory_vs_rate",
    "page_lines",
    "passes",
    "pool_mib",
    "request_agreement",
    "serving_table",
    "serving_views",
    "sustained_rates",
    "sustained_table",
    "token_ids",
    "trace_table",
]
