"""The statistics behind the verdicts, on synthetic numbers whose right answer is known by construction: two equal
engines are called different about ALPHA of the time and a 20 % difference is found; a 20 pp accuracy drop is found,
an equal policy is equivalent, retention resamples whole conversations."""

import math

import numpy as np
import pandas as pd
import pytest

from kvlib.report import stats


def timings(rng, n, scale):
    """Realistic timing noise: 6 % log-normal, and one timing in ten slowed 10-40 % by a stall of the host."""
    x = scale * np.exp(rng.normal(0, 0.06, n))
    return x * (1 + (rng.random(n) < 0.1) * rng.uniform(0.1, 0.4, n))


def rates(n=5, sims=600, seed=1):
    """(share of A/A comparisons called different, share of 20 %-slower comparisons found) over `sims` draws."""
    rng = np.random.default_rng(seed)
    same = [stats.compare_timings(timings(rng, n, 1.0), timings(rng, n, 1.0)).verdict for _ in range(sims)]
    slower = [stats.compare_timings(timings(rng, n, 1.2), timings(rng, n, 1.0)).verdict for _ in range(sims)]
    return np.mean([v != stats.NOT_DISTINGUISHABLE for v in same]), np.mean([v == stats.LARGER for v in slower])


def test_the_timing_rule_calls_equal_engines_different_at_most_about_five_percent_of_the_time():
    false_positives, power = rates()
    print(f"timing rule, 5 repeats a side: false-positive rate {false_positives:.3f}, power at 20 % {power:.3f}")
    assert false_positives <= 0.07  # exact test: <= 12/252 = 4.8 % expected, plus simulation noise
    assert power >= 0.7


def test_two_repeats_never_judge_and_four_can():
    assert stats.repeats_needed() == 4
    two = stats.compare_timings([1.0, 1.01], [2.0, 2.02])  # twice as slow, yet 2 + 2 repeats cannot show it at 5 %
    assert two.verdict == stats.TOO_FEW and not two.judged and two.ratio == pytest.approx(0.5, rel=0.01)
    four = stats.compare_timings([1.0, 1.01, 0.99, 1.02], [2.0, 2.02, 1.98, 2.01])
    assert four.verdict == stats.SMALLER and four.low < 0.5 < four.high < 1
    assert four.p_value == pytest.approx(2 / 70)


def test_the_interval_of_the_ratio_excludes_one_exactly_when_the_test_rejects():
    rng = np.random.default_rng(3)
    for _ in range(30):
        a, b = timings(rng, 6, 1.0), timings(rng, 5, 1.1)
        c = stats.compare_timings(a, b)
        assert (c.p_value <= stats.ALPHA) == (c.verdict != stats.NOT_DISTINGUISHABLE)
        assert c.low <= c.ratio <= c.high


def test_many_repeats_use_random_splits_and_stay_calibrated():
    rng = np.random.default_rng(4)
    c = stats.compare_timings(timings(rng, 12, 1.0), timings(rng, 12, 1.3))
    assert not c.exact and c.verdict == stats.SMALLER


def test_attained_size_and_coverage_of_the_exact_test():
    """4 against 4 splits 70 ways, 2 of them as extreme as complete separation: the test "at 5 %" rejects only there,
    so its real size is 2/70 and its intervals cover 68/70; 6 against 6: 2/924 steps, 46 of them fit under 5 %."""
    assert stats.attained_size(4, 4) == pytest.approx(2 / 70)
    assert stats.attained_size(6, 6) == pytest.approx(46 / 924)
    assert stats.attained_size(2, 2) == 0.0
    assert "at 4 repeats a side its real size is 2.9 % and its intervals cover 97.1 %" in stats.timing_rule(
        repeats=4, paired=False)
    # round by round: 2^n sign flips, 2 of them extreme; 8 rounds: steps of 1/128, 6 of them under 5 %
    assert stats.attained_size(8, 8, paired=True) == pytest.approx(6 / 128)
    assert "at 8 rounds its real size is 4.7 % and its intervals cover 95.3 %" in stats.timing_rule(repeats=8)
    assert stats.repeats_needed(paired=True) == 6 and stats.attained_size(5, 5, paired=True) == 0.0


def test_rounds_are_compared_round_by_round():
    """A slow round weighs on both sides alike when paired: B is 5 % slower than A in every round, though the rounds
    differ by 30 %; as two samples the rounds' spread hides it, round by round it is plain."""
    rounds = pd.Series([1.0, 1.3, 0.8, 1.1, 0.9, 1.2, 1.05, 0.95]).rename_axis("round")
    a, b = rounds, rounds / 1.05
    paired = stats.compare_timings(a, b)
    assert paired.paired and paired.verdict == stats.LARGER and paired.ratio == pytest.approx(1.05)
    unpaired = stats.compare_timings(list(a), list(b))
    assert not unpaired.paired and unpaired.verdict == stats.NOT_DISTINGUISHABLE
    frame = pd.DataFrame({"repeat": range(8), "tps": list(a)})
    assert stats.by_round(frame, "tps").index.name == "round"
    assert stats.by_round(pd.concat([frame, frame]), "tps").index.name is None  # a repeated round: two samples


@pytest.mark.parametrize("p, rejected", [
    ([0.01, 0.04, 0.03, 0.005], [True, False, False, True]),  # 0.005 <= .05/4, 0.01 <= .05/3, 0.03 > .05/2: stop
    ([0.01, 0.015, 0.02, 0.04], [True, True, True, True]),  # .0125, .0167, .025, .05: each passes its step
    ([0.01, 0.03, 0.001, 0.04], [True, False, True, False]),  # .001 <= .0125, .01 <= .0167, then .03 > .025: stop
    ([0.02, 0.001], [True, True]),  # 0.001 <= .05/2, then 0.02 <= .05/1
    ([0.03, 0.03], [False, False]),  # 0.03 > .05/2 stops at once, though each alone is under .05
    ([0.2, float("nan")], [False, False]),
])
def test_holm_on_known_p_values(p, rejected):
    assert stats.holm(p) == rejected


def test_a_range_claim_confirms_inside_refutes_outside_and_holds_both_edges():
    a, b = [100, 101, 99, 100.5, 99.5, 100.2], [10, 10.1, 9.9, 10.05, 9.95, 10.02]
    inside = stats.range_claim("10x", a, b, 10 / 10**0.5, 10 * 10**0.5)
    assert inside.inside and inside.p_value == pytest.approx(2 / 924) and stats.settle([inside]) == ["confirmed"]
    outside = stats.range_claim("3x", a, b, 2.5, 3.5)
    assert not outside.inside and stats.settle([outside]) == ["refuted"]
    noisy = stats.range_claim("faster", [1.0, 1.3, 0.9, 1.2], [1.1, 0.95, 1.25, 1.0], 1.0)
    assert stats.settle([noisy]) == ["inconclusive"]


def finding_2_family(values, devices):
    """The findings' family for finding 2 (kvlib.report.findings.verdicts.throughput_claims) on {runner: timings}."""
    runs = values
    scale = devices["h2o"] / devices["vllm"]
    return [stats.range_claim("vllm > h2o", runs["vllm"], runs["h2o"], 1.0),
            stats.range_claim("vllm > infinigen", runs["vllm"], runs["infinigen"], 1.0),
            stats.range_claim("10x", runs["vllm"], runs["infinigen"], 10 / 10**0.5, 10 * 10**0.5),
            stats.range_claim("3x per GB", runs["h2o"], runs["vllm"], 3 / 2**0.5 * scale, 3 * 2**0.5 * scale)]


def simulated_book_false_positive_rate(shuffled: bool, books: int = 1000, drift: float = 0.04, seed: int = 7) -> float:
    """A/A of the book's design: vLLM, H2O and InfiniGen equally fast, the batch-scaling point repeated as the embedded
    profile repeats it, rounds ordered as the executor orders them (kvlib.study.executor.rounds), each run slowed by
    `drift` per slot of its round (the machine warming, memory filling). Under that truth every settled
    directional claim and every confirmed magnitude claim of finding 2's family is false; the share of books with at
    least one such claim is the family-wise false-positive rate."""
    from pathlib import Path

    from kvlib.study.executor import rounds
    from kvlib.study.profile import load_profile

    repeats = load_profile("embedded", Path(__file__).parents[2]).repeats("batch_scaling")
    rng = np.random.default_rng(seed)
    runners = ["vllm", "h2o", "infinigen", "full", "paged"]  # others share the rounds, as in the book
    wrong_books = 0
    for book in range(books):
        runs = {r: {} for r in runners}
        for runner, round_, slot in rounds(runners, repeats, f"aa/{book}", shuffled=shuffled):
            runs[runner][round_] = timings(rng, 1, 1.0)[0] * (1 - drift) ** slot
        by_round = {r: pd.Series(v).rename_axis("round") for r, v in runs.items()}  # as stats.by_round gives them
        verdicts = stats.settle(finding_2_family(by_round, {"vllm": 1.0, "h2o": 1.0}))
        wrong_books += any(v != "inconclusive" for v in verdicts[:2]) or "confirmed" in verdicts[2:]
    return wrong_books / books


def test_a_simulated_aa_of_the_books_design_keeps_its_family_wise_error_within_five_percent():
    random_order = simulated_book_false_positive_rate(shuffled=True)
    fixed_order = simulated_book_false_positive_rate(shuffled=False)
    print(f"A/A of finding 2's family: {random_order:.3f} of books with a false claim in random order, "
          f"{fixed_order:.3f} in a fixed order")
    assert random_order <= 0.05 + 2 * (0.05 * 0.95 / 1000) ** 0.5  # <= 5 %, plus the simulation's own error
    assert fixed_order > 0.2  # the drift the random order protects against is real for a fixed order


def items(n, accuracy, rng):
    return (rng.random(n) < accuracy).astype(float)


def test_a_20_pp_drop_is_found_and_an_equal_policy_is_equivalent():
    rng = np.random.default_rng(5)
    full = items(400, 0.8, rng)
    lossy = full * (rng.random(400) >= 0.25)  # a quarter of the right answers lost: 20 pp
    ids = {"task": "t", "doc_id": np.arange(400)}
    ref = pd.DataFrame({**ids, "correct": full})
    drop = stats.paired_drop(ref, pd.DataFrame({**ids, "correct": lossy}), "correct", ["task", "doc_id"])
    assert drop.paired and drop.verdict == stats.LOWER and drop.low < 0.2 < drop.high and drop.low > 0.1
    # the same policy twice: each run answers 3 % of the items the other way (a tie broken by rounding, say)
    again, other = (np.where(rng.random(400) < 0.03, 1 - full, full) for _ in range(2))
    equal = stats.paired_drop(pd.DataFrame({**ids, "correct": again}), pd.DataFrame({**ids, "correct": other}),
                              "correct", ["task", "doc_id"])
    assert equal.verdict == stats.EQUIVALENT and -0.05 < equal.low and equal.high < 0.05


def test_pairing_is_on_item_ids_not_row_order():
    ref = pd.DataFrame({"doc_id": range(100), "correct": [1.0, 0.0] * 50})
    shuffled = ref.sample(frac=1, random_state=0)  # the same answers in another order: no drop at all
    drop = stats.paired_drop(ref, shuffled, "correct", ["doc_id"])
    assert drop.drop == 0 and drop.verdict == stats.EQUIVALENT
    assert -drop.low == drop.high == pytest.approx(stats.resolution(100, 0.95))  # what 100 items can resolve


def test_few_items_never_settle_anything():
    """2 items both lost: a bootstrap says -100 pp with no spread; the sign test (p = 0.5) and the floor say: nothing
    shown. 2 items both kept alike are not 'equivalent' either."""
    ids = pd.DataFrame({"doc_id": [0, 1]})
    lost = stats.paired_drop(ids.assign(correct=1.0), ids.assign(correct=0.0), "correct", ["doc_id"])
    assert lost.drop == 1.0 and lost.verdict == stats.INCONCLUSIVE
    alike = stats.paired_drop(ids.assign(correct=1.0), ids.assign(correct=1.0), "correct", ["doc_id"])
    assert alike.verdict == stats.INCONCLUSIVE and alike.high > 0.5
    assert stats.sign_test_p(9, 0) == pytest.approx(2 / 2**9) and stats.sign_test_p(2, 0) == 0.5


def test_without_item_ids_the_drop_is_unpaired_and_says_so():
    ref = pd.DataFrame({"correct": [1.0] * 40})
    drop = stats.paired_drop(ref, pd.DataFrame({"correct": [1.0] * 20 + [0.0] * 20}), "correct", ["doc_id"])
    assert not drop.paired and drop.drop == pytest.approx(0.5) and drop.verdict == stats.LOWER


def test_an_a_a_accuracy_comparison_is_within_noise_about_as_often_as_stated():
    rng = np.random.default_rng(6)
    called = 0
    for _ in range(100):
        truth = rng.random(150) < 0.7  # items the model can do; each run answers each item with some luck
        a, b = (np.where(rng.random(150) < 0.1, ~truth, truth).astype(float) for _ in range(2))
        ids = np.arange(150)
        d = stats.paired_drop(pd.DataFrame({"doc_id": ids, "correct": a}), pd.DataFrame({"doc_id": ids, "correct": b}),
                              "correct", ["doc_id"], draws=500)
        called += d.verdict in (stats.LOWER, stats.HIGHER)
    assert called <= 10


def test_retention_resamples_conversations_within_buckets():
    """Questions of one conversation share its context: when a conversation is answered all right or all wrong, the
    cluster interval is wider than one that treats its questions as independent."""
    rng = np.random.default_rng(7)
    rows = []
    for bucket in ("1K-2K", "2K-4K"):
        for conv in range(20):
            kept = rng.random() < 0.6  # the policy keeps the fact for a whole conversation, or loses it
            rows += [{"bucket": bucket, "conversation": f"{bucket}-{conv}", "turn": t, "full": 1.0,
                      "policy": float(kept)} for t in range(2, 14, 2)]
    frame = pd.DataFrame(rows)
    ref, other = frame.rename(columns={"full": "correct"}), frame.rename(columns={"policy": "correct"})
    item = ["bucket", "conversation", "turn"]
    clustered = stats.paired_drop(ref, other, "correct", item, cluster=["bucket", "conversation"], stratum="bucket")
    naive = stats.paired_drop(ref, other, "correct", item)
    assert clustered.clusters == 40 and clustered.items == 240 and clustered.verdict == stats.LOWER
    assert clustered.high - clustered.low > 2 * (naive.high - naive.low)


def test_bonferroni_levels_and_the_verdict_words():
    assert stats.family_level(1) == pytest.approx(0.95) and stats.family_level(10) == pytest.approx(0.995)
    assert stats.drop_verdict(-0.02, 0.03) == stats.EQUIVALENT
    assert stats.drop_verdict(0.01, 0.12) == stats.LOWER
    assert stats.drop_verdict(-0.12, -0.06) == stats.HIGHER
    assert stats.drop_verdict(-0.04, 0.09) == stats.INCONCLUSIVE


def test_an_interval_that_excludes_zero_is_never_called_inconclusive():
    """40 RULER items, 8 lost and none gained, at the findings page's Bonferroni level (12 intervals): the bootstrap
    alone excludes 0, the exact sign test (p = 2/256) cannot reject at 0.4 %; the interval then reaches 0 and the word
    follows it. At 95 % both reject: lower, the interval above 0."""
    ids = pd.DataFrame({"doc_id": range(40)})
    other = ids.assign(correct=[0.0] * 8 + [1.0] * 32)
    strict = stats.paired_drop(ids.assign(correct=1.0), other, "correct", ["doc_id"], level=stats.family_level(12))
    assert strict.verdict == stats.INCONCLUSIVE and strict.low <= 0 <= strict.high
    plain = stats.paired_drop(ids.assign(correct=1.0), other, "correct", ["doc_id"])
    assert plain.verdict == stats.LOWER and plain.low > 0


def test_thin_tails_get_enough_bootstrap_draws():
    assert stats.accuracy.draws_for(0.95) == stats.DRAWS
    level = stats.family_level(12)  # 0.2 % a tail
    assert stats.accuracy.draws_for(level) * (1 - level) / 2 >= 50


def test_a_difference_is_read_on_its_side_of_zero_whatever_the_margin():
    """drop_verdict reads near-the-baseline first; difference_verdict, for a claim that one side loses more, reads
    only which side of 0 the interval lies: an extra loss of 1 to 4 pp is a loss."""
    assert stats.drop_verdict(0.01, 0.04) == stats.EQUIVALENT
    assert stats.accuracy.difference_verdict(0.01, 0.04) == stats.LOWER
    assert stats.accuracy.difference_verdict(-0.04, -0.01) == stats.HIGHER
    assert stats.accuracy.difference_verdict(-0.01, 0.04) == stats.INCONCLUSIVE
    assert stats.accuracy.difference_verdict(math.nan, math.nan) == stats.INCONCLUSIVE


def test_power_counts_the_units_at_which_a_claim_comes_out_confirmed_eight_times_in_ten():
    """confirm_chance is the chance an interval lands inside the claim's range; units_for_power the fewest units
    at which it reaches 80 %: 50 % at the range's edge, none where the interval is wider than the range."""
    assert stats.accuracy.confirm_chance(0.2, 0.01, 0.05, 0.0, 0.25) == pytest.approx(0.5)
    assert stats.accuracy.confirm_chance(0.2, 0.01, 0.2, 0.1, 0.3) == 0.0
    assert stats.accuracy.confirm_chance(0.1, 0.0, 0.05, 0.0, math.inf) == 1.0
    # a mean of n units each +-1: interval 1.96 / sqrt(n) at 95 %; 0.5 confirmed "above 0" 80 % of the time from 32
    z = stats.two_sided_z(0.95)
    needed = stats.accuracy.units_for_power(lambda n: stats.accuracy.confirm_chance(0.5, 1 / n**0.5, z / n**0.5, 0.0, math.inf))
    assert needed == math.ceil(((z + stats.normal_quantile(0.8)) / 0.5) ** 2)
    assert stats.accuracy.units_for_power(lambda n: 0.0, most=1000) is None
