"""The statistics the book's verdicts rest on: pure functions of numbers and frames (numpy, pandas), seeded, so the
same results always read the same way. Timings (kvlib.report.stats.timing): a permutation test on the repeats, read
round by round, ratios of geometric means, families of claims settled by Holm. Accuracy
(kvlib.report.stats.accuracy): paired drops against the full cache with bootstrap intervals.
"""

from kvlib.report.stats.accuracy import (
    DRAWS,
    EQUIVALENCE_MARGIN,
    Drop,
    bootstrap_means,
    drop_verdict,
    family_level,
    mean_interval,
    paired_drop,
    resolution,
    sign_test_p,
)
from kvlib.report.stats.rule import (
    ALPHA,
    CONFIRMED,
    EQUIVALENT,
    HIGHER,
    INCONCLUSIVE,
    LARGER,
    LOWER,
    REFUTED,
    SEED,
    SMALLER,
    TOO_FEW,
    WITHIN_NOISE,
)
from kvlib.report.stats.timing import (
    EQUIVALENCE_TIMING,
    EXACT_SPLITS,
    PERMUTATIONS,
    RangeClaim,
    TimingComparison,
    attained_size,
    by_round,
    compare_timings,
    holm,
    range_claim,
    repeats_needed,
    settle,
    smallest_p_value,
    timing_equivalent,
    timing_rule,
)

__all__ = [
    "ALPHA", "CONFIRMED", "DRAWS", "EQUIVALENCE_MARGIN", "EQUIVALENCE_TIMING", "EQUIVALENT", "EXACT_SPLITS", "HIGHER",
    "INCONCLUSIVE", "LARGER", "LOWER", "PERMUTATIONS", "REFUTED", "SEED", "SMALLER", "TOO_FEW", "WITHIN_NOISE", "Drop", "RangeClaim", "TimingComparison", "attained_size", "bootstrap_means", "by_round",
    "compare_timings", "drop_verdict", "family_level", "holm", "mean_interval", "paired_drop", "range_claim",
    "repeats_needed", "resolution", "settle", "sign_test_p", "smallest_p_value", "timing_equivalent", "timing_rule",
]
