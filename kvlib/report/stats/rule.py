"""What every verdict of the book shares: its error rate, its seed, and the words it is read in."""

ALPHA = 0.05  # the false-positive rate of every verdict, per comparison (timing) or per page or family (adjusted)
SEED = 0

# timing verdicts: A against B
LARGER, SMALLER, NOT_DISTINGUISHABLE, TOO_FEW = "larger", "smaller", "not distinguishable", "too few repeats to judge"
# accuracy verdicts: the policy against its reference
LOWER, HIGHER, EQUIVALENT, INCONCLUSIVE = "lower", "higher", "equivalent", "inconclusive"
# claims (a finding, or one of a family's claims): settled either way, or not (INCONCLUSIVE)
CONFIRMED, REFUTED = "confirmed", "refuted"
