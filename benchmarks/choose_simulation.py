"""The chooser's two error rates, simulated through kvlib's own functions (issue 64; the fast checks are
tests/report/test_choose_best.py and tests/projection/test_power_rule.py):

1. equal runners: how often `kvlib choose` (kvlib.report.choose.workload.choose, on batch-scaling rows of 10 rounds,
   each round a machine-wide factor and each run its own noise) names a winner, i.e. calls some rival slower, against
   the decode share of its error rate;
2. the "about N items would resolve it" rule: the chance that stats.paired_drop settles it at N binary items if the
   measured shares of items lost and gained held, worked out exactly over the counts N items can give.

    .venv/bin/python benchmarks/choose_simulation.py [--draws 4000] [--skip-power]

Runs against whatever kvlib is importable (PYTHONPATH=<an older checkout> to measure an older rule: part 2 needs the
new rule's signature)."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from kvlib.report.choose.workload import choose
from kvlib.report.pages import CHOOSER

ROUNDS = 10


def equal_runner_rows(rng, runners: int, noise: float = 0.05) -> pd.DataFrame:
    logs = np.log(100.0) + rng.normal(0, noise, (ROUNDS, 1)) + rng.normal(0, noise, (ROUNDS, runners))
    return pd.DataFrame([{"policy": f"r{i:02d}", "lossless": True, "batch_size": 4, "oom": False,
                          "decode_tokens_per_s": math.exp(logs[r, i]), "device_peak_bytes": 2**30,
                          "min_prompt_tokens": 128, "max_prompt_tokens": 1024, "max_new_tokens": 32, "budget": None,
                          "repeat": r, "stat_decode_attention": "c"} for r in range(ROUNDS) for i in range(runners)])


def named_a_winner(draws: int, runners: int, seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(draws):
        answer = choose({"batch_scaling": equal_runner_rows(rng, runners)}, 512, 4, 32)
        hits += len(answer.decode_ties) < runners - 1
    return hits


def upper_bound(hits: int, draws: int, confidence: float = 0.95) -> float:
    """The one-sided Clopper-Pearson upper bound of a rate (bisection on the binomial tail)."""
    def tail(p):  # P(X <= hits | p)
        return sum(math.exp(math.lgamma(draws + 1) - math.lgamma(k + 1) - math.lgamma(draws - k + 1)
                            + k * math.log(p) + (draws - k) * math.log1p(-p)) for k in range(hits + 1))
    low, high = hits / draws, 1.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if tail(mid) > 1 - confidence else (low, mid)
    return high


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--draws", type=int, default=4000)
    parser.add_argument("--skip-power", action="store_true")
    args = parser.parse_args()
    share = CHOOSER.share("decode")
    print(f"1. equal runners, {ROUNDS} rounds, the decode share {share:.2%}: answers naming a winner")
    for runners in (4, 11):
        start = time.time()
        hits = named_a_winner(args.draws, runners)
        print(f"   {runners:2d} runners: {hits} of {args.draws} = {hits / args.draws:.2%} (95% upper bound "
              f"{upper_bound(hits, args.draws):.2%}) [{time.time() - start:.0f} s]", flush=True)
    if args.skip_power:
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_power_rule import measured, realised_power  # the tests' exact sum over counts, through paired_drop

    print("2. the N-items rule: realised power at N (and at 0.8 N) on binary items, if the measured shares held")
    for lost, gained, items, tolerance, level in [(0, 0, 50, 5.0, 0.999), (6, 1, 200, 5.0, 0.95),
                                                  (6, 1, 200, 5.0, 0.99), (5, 2, 100, 10.0, 0.95),
                                                  (3, 3, 60, 5.0, 0.95), (2, 0, 40, 10.0, 0.99),
                                                  (9, 0, 60, 5.0, 0.95), (3, 1, 60, 12.0, 0.95)]:
        start = time.time()
        needed = measured(lost, gained, items, tolerance, level)
        power = [realised_power(lost / items, gained / items, n, tolerance, level) for n in (needed, int(0.8 * needed))]
        print(f"   {lost} lost, {gained} gained of {items}, tolerance {tolerance:g} pp, {level:.1%} intervals: "
              f"N = {needed}, power {power[0]:.1%} (at {int(0.8 * needed)}: {power[1]:.1%}) "
              f"[{time.time() - start:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
