"""The chooser names the fastest runner and the rivals it cannot tell from it (kvlib.report.stats.timing.
compare_with_best). The pick is read from the same timings, so each rival's test must allow for it: among equal
runners, simulated here by round as the book measures them (10 rounds), the answer may call some rival slower at
most at its share of the error rate. Testing every rival against the pick at that share (Holm over the rivals, the
rule before) did so in 4.9 % of answers with 11 runners and 3.4 % with 4 at a share of 2.5 %
(benchmarks/choose_simulation.py prints both rules' rates)."""

import math

import numpy as np
import pandas as pd
import pytest

from kvlib.report.pages import CHOOSER
from kvlib.report.stats.best import compare_with_best
from kvlib.report.stats.timing import compare_timings

ROUNDS = 10  # the embedded book's rounds at each batch-scaling point


def timings(rng, speeds, rounds=ROUNDS, noise=0.05):
    """One grid point's tokens/s: each round a machine-wide factor (a slow round slows every runner in it) and each
    run its own noise."""
    round_factor = rng.normal(0, noise, (rounds, 1))
    logs = np.log(speeds)[None, :] + round_factor + rng.normal(0, noise, (rounds, len(speeds)))
    return pd.DataFrame(np.exp(logs), columns=[f"r{i:02d}" for i in range(len(speeds))]).rename_axis("round")


def wrongly_called(draws, speeds, alpha, equal, larger_is_better=True, seed=1):
    """How many of `draws` answers call slower a rival that is as fast as the pick (`equal`: the runners of equal
    speed, by column). TTFT (larger_is_better False) reads seconds: the timings inverted."""
    rng = np.random.default_rng(seed)
    wrong = 0
    for _ in range(draws):
        t = timings(rng, np.asarray(speeds, dtype=float))
        if not larger_is_better:
            t = 1 / t
        logs = np.log(t).mean()
        best = logs.idxmax() if larger_is_better else logs.idxmin()
        answer = compare_with_best(t, best, alpha, larger_is_better)
        wrong += best in equal and bool(set(answer.slower) & set(equal))
    return wrong


def exceeds(hits, draws, share, confidence=0.99):
    """Whether `hits` of `draws` show the rate above `share`: the exact binomial chance of at least that many at
    the share itself is below 1 - confidence."""
    log_pmf = [math.lgamma(draws + 1) - math.lgamma(k + 1) - math.lgamma(draws - k + 1) + k * math.log(share)
               + (draws - k) * math.log1p(-share) for k in range(hits, draws + 1)]
    return sum(math.exp(v) for v in log_pmf) < 1 - confidence


@pytest.mark.parametrize("runners", [4, 11])
def test_equal_runners_are_called_different_at_most_at_the_answers_share(runners, draws=2000):
    """2.5 % (the decode ties' share) over 2,000 answers: the old rule's 3.4 % (68 answers) and 4.9 % (98) are both
    shown above it at 99 % confidence, the rule's own ~2.5 % is not."""
    alpha = CHOOSER.share("decode")
    columns = [f"r{i:02d}" for i in range(runners)]
    hits = wrongly_called(draws, [100.0] * runners, alpha, columns)
    assert not exceeds(hits, draws, alpha), f"{hits} of {draws} answers named a winner among equal runners"
    assert exceeds(68, draws, alpha) and exceeds(98, draws, alpha)  # the bound can fail: it would on the old rule


def test_the_ttft_question_holds_its_share_too():
    alpha = CHOOSER.share("TTFT")
    hits = wrongly_called(1000, [1.0] * 4, alpha, [f"r{i:02d}" for i in range(4)], larger_is_better=False, seed=2)
    assert not exceeds(hits, 1000, alpha)


def test_far_slower_runners_neither_hide_a_near_one_nor_let_equal_ones_be_told_apart():
    """Three equal leaders and five 30 % slower: the slower are shown slower in nearly every answer, and a leader is
    called slower than the pick at most at the share (the step-down's last set is the leaders alone)."""
    alpha = CHOOSER.share("decode")
    speeds = [100.0] * 3 + [70.0] * 5
    assert not exceeds(wrongly_called(500, speeds, alpha, ["r00", "r01", "r02"], seed=3), 500, alpha)
    rng = np.random.default_rng(4)
    found = [set(compare_with_best(t, t.mean().idxmax(), alpha).slower)
             for t in (timings(rng, np.asarray(speeds)) for _ in range(100))]
    assert np.mean([{f"r{i:02d}" for i in range(3, 8)} <= s for s in found]) > 0.95


def test_one_rival_is_the_by_round_test_and_rows_without_rounds_are_samples():
    rng = np.random.default_rng(5)
    t = timings(rng, np.array([100.0, 97.0]))
    answer = compare_with_best(t, "r00", 0.05)
    assert answer.p_values["r01"] == pytest.approx(compare_timings(t["r01"], t["r00"]).p_value)
    assert answer.rounds == ROUNDS and answer.exact
    samples = compare_with_best(t.rename_axis(None).assign(r02=[50.0, 51.0] + [np.nan] * 8), "r00", 0.05)
    assert samples.rounds == 0 and "r02" in samples.slower  # two timings of 50 against ten of ~100
    few = compare_with_best(t.assign(r02=[50.0] + [np.nan] * 9), "r00", 0.05)
    assert "r02" in few.ties and math.isnan(few.p_values["r02"])  # one timing: nothing shows it slower
