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
