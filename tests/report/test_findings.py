"""The chapters' sentences describe timings as ratios with the permutation test's interval and never rank (a ranking
is a claim of the findings' declared family: tests/report/test_verdicts.py), within one kind of machine; accuracy by
paired drops with intervals."""

import numpy as np
import pandas as pd
import pytest

from kvlib.report import batch_scaling as batch_page
from kvlib.report import measures, stats
from kvlib.report import retention as retention_page
from kvlib.report import ttft as ttft_page
from kvlib.report.accuracy import lines as accuracy_page


def ttft_rows(policy, values, prompt_tokens=512):
    return [{"policy": policy, "prefill": "fused", "prompt_tokens": prompt_tokens, "ttft_s": v, "oom": False}
            for v in values]


def test_ttft_is_described_as_a_ratio_with_the_tests_interval_never_ranked():
    apart = pd.DataFrame(ttft_rows("full", [1.0, 1.1, 1.05, 1.02, 1.08]) + ttft_rows("paged", [0.5, 0.52, 0.55, 0.51, 0.53]))
    lines = ttft_page.lines(apart)
    assert any("paged/fused / full/fused TTFT: 0.50x (interval" in line for line in lines)
    assert not any("faster" in line for line in lines)
    rule = [line for line in lines if line.startswith("How timings are read")]
    # said once, with the real size and coverage of the exact test at the page's 5 repeats (2/252 steps: 4.8 %)
    assert len(rule) == 1 and "at 5 repeats a side its real size is 4.8 % and its intervals cover 95.2 %" in rule[0]
    close = pd.DataFrame(ttft_rows("full", [1.0, 1.3, 1.05, 0.98, 1.2]) + ttft_rows("paged", [0.9, 1.1, 0.95, 1.25, 1.0]))
    assert any("not distinguishable at 5 repeats" in line for line in ttft_page.lines(close))
    assert not any(line.startswith("Ours") and ("same" in line or "faster" in line) for line in ttft_page.lines(close))


def test_two_repeats_are_too_few_for_an_interval_however_far_apart():
    """Two repeats a side split 6 ways: a difference could never reach 5 %, so no interval is given (min-max ranges
    that do not overlap happen one time in three for identical engines)."""
    apart = pd.DataFrame(ttft_rows("full", [1.0, 1.1]) + ttft_rows("paged", [0.5, 0.52]))
    lines = ttft_page.lines(apart)
    assert any("too few repeats for an interval: 2 and 2" in line for line in lines)
    assert not any("faster" in line for line in lines)


def decode_rows(policy, values, kernel="c", **machine):
    return [{"policy": policy, "batch_size": 8, "oom": False, "decode_tokens_per_s": v, "decode_steps": 31,
             "device_peak_bytes": 2**30, "host_peak_bytes": 0, "stat_decode_attention": kernel, **machine}
            for v in values]


def test_decode_throughputs_are_described_from_the_repeats():
    rows = (decode_rows("full", [50.0, 51.5, 49.0, 50.5, 48.5]) + decode_rows("paged", [51.0, 49.5, 50.5, 52.0, 49.0])
            + decode_rows("h2o", [80.0, 78.0, 82.5, 79.0, 81.0]))
    lines = batch_page.lines(pd.DataFrame(rows))
    assert any("the highest decode throughput by geometric mean is h2o" in line for line in lines)
    assert any("h2o / paged decode throughput: 1.59x (interval" in line for line in lines)
    paged = next(line for line in lines if "paged / full decode throughput" in line)
    # 5 repeats a side, ~2 % apart: described, never called alike (the page's one tested statement is its lead)
    assert "not distinguishable at 5 repeats" in paged and "equivalent" not in paged
    h2o = next(line for line in lines if "h2o / full decode throughput" in line)
    assert "equivalent" not in h2o and "not distinguishable" not in h2o and "per GiB" in h2o
    assert any("geometric mean and range of 5 repeats" in line for line in lines)  # no per-step quartiles claimed
    assert not any("faster" in line for line in lines)


def test_the_same_policy_under_two_names_is_not_called_different():
    """A/A: one engine entered twice in one grid (its repeats interleaved) is no finding."""
    rows = decode_rows("full", [50.0, 52.0, 48.0, 51.0, 49.0]) + decode_rows("full_again", [51.0, 49.0, 50.0, 48.0, 52.0])
    lines = batch_page.lines(pd.DataFrame(rows))
    line = next(line for line in lines if "/ full decode throughput" in line or "/ full_again decode" in line)
    assert "not distinguishable" in line
    assert not any("faster" in line for line in lines)


def test_rows_of_two_kinds_of_machine_are_never_compared():
    """full measured on a CPU-only machine and on a GPU machine, paged only on the CPU one: paged is compared with the
    CPU machine's full alone, and the GPU machine's speed never enters a CPU verdict."""
    cpu = {"machine_cpu": "AMD EPYC", "machine_gpu": None, "machine_host": "a"}
    gpu = {"machine_cpu": "Intel Xeon", "machine_gpu": "NVIDIA H100", "machine_host": "b"}
    rows = (decode_rows("full", [50.0, 51.5, 49.0, 50.5, 48.5], **cpu) + decode_rows("paged", [51.0, 49.5, 50.0, 52.0, 49.0], **cpu)
            + decode_rows("full", [500.0, 510.0, 490.0, 505.0, 495.0], **gpu))
    lines = batch_page.lines(pd.DataFrame(rows))
    assert any("measured on 2 kinds of machine (AMD EPYC with no GPU: 10 rows; Intel Xeon with NVIDIA H100: 5 rows)"
               in line for line in lines)
    on_cpu = [line for line in lines if line.startswith("Ours, on AMD EPYC with no GPU:")]
    on_gpu = [line for line in lines if line.startswith("Ours, on Intel Xeon with NVIDIA H100:")]
    assert any("paged / full decode throughput" in line and "(interval" in line for line in on_cpu)
    assert not any("paged" in line for line in on_gpu) and any("499.9" in line for line in on_gpu)  # the geometric mean
    assert not any(line.startswith("Ours: ") and " / " in line for line in lines)
    same_kind = [{**r, "machine_host": "c"} for r in decode_rows("paged", [51.0, 50.0], **cpu)]  # another host, alike
    assert not any("kinds of machine" in line
                   for line in batch_page.lines(pd.DataFrame(rows[:10] + same_kind)))


def test_throughputs_from_different_decode_kernels_are_not_compared():
    rows = [{"policy": p, "batch_size": 8, "oom": False, "decode_tokens_per_s": tps, "decode_steps": 31,
             "device_peak_bytes": 2**30, "host_peak_bytes": 0, "stat_decode_attention": kernel}
            for p, tps, kernel in [("full", 50.0, "c"), ("paged", 53.0, "c"), ("h2o", 20.0, "torch")]
            for _ in range(2)]
    lines = batch_page.lines(pd.DataFrame(rows))
    assert any("did not all decode with the same attention kernel (c: full, paged; torch: h2o)" in line
               for line in lines)
    assert any(line.startswith("Ours: h2o vs full") and "not compared" in line for line in lines)
    assert not any("h2o / full" in line for line in lines)
    assert any("paged / full decode throughput" in line and "per GiB" in line for line in lines)


@pytest.mark.parametrize("correct, n, low, high", [(12, 12, 0.757, 1.0), (6, 12, 0.254, 0.746), (0, 36, 0.0, 0.096)])
def test_wilson_interval(correct, n, low, high):
    assert measures.wilson(correct, n) == pytest.approx((low, high), abs=1e-3)


@pytest.mark.parametrize("n", [20, 100, 300, 500, 540, 600])
def test_wilson_interval_holds_its_share_at_the_ends(n):
    """All correct or none: the interval's bound is the share itself (the accuracy figure's error bars are the
    distances to the bounds, and rounding put 300 of 300's upper bound 1e-16 below 1)."""
    assert measures.wilson(n, n)[1] == 1.0
    assert measures.wilson(0, n)[0] == 0.0


def test_one_recall_item_is_within_noise():
    """12 items: H2O one item behind InfiniGen is no finding; nine items behind is."""
    def rows(policy, correct, budget=0.1):
        return [{"task": "kvlib_recall", "policy": policy, "budget": budget, "doc_id": i, "correct": float(i < correct)}
                for i in range(12)]
    near = pd.DataFrame(rows("full", 12, None) + rows("h2o", 8) + rows("infinigen", 9))
    assert any("H2O and InfiniGen are not distinguishable on these 12 units" in line for line in accuracy_page.lines(near))
    far = pd.DataFrame(rows("full", 12, None) + rows("h2o", 2) + rows("infinigen", 11))
    assert any("H2O loses more than InfiniGen (H2O's change from InfiniGen -75.0 pp" in line
               for line in accuracy_page.lines(far))
    unpaired = far.drop(columns="doc_id")  # results from before rows carried item ids: said, and still read
    lines = accuracy_page.lines(unpaired)
    assert any("could not pair their items" in line for line in lines)
    assert any("H2O loses more than InfiniGen" in line for line in lines)


def accuracy_rows(rng, items=200):
    full = (rng.random(items) < 0.8).astype(float)
    rows = [{"task": "recall", "policy": "full", "budget": None, "doc_id": i, "correct": full[i]} for i in range(items)]
    lossy = full * (rng.random(items) >= 0.25)  # a quarter of the right answers lost: 20 pp
    for policy, scores in (("h2o", lossy), ("infinigen", full)):
        rows += [{"task": "recall", "policy": policy, "budget": 0.1, "doc_id": i, "correct": scores[i]}
                 for i in range(items)]
    return pd.DataFrame(rows)


def test_a_known_20_pp_drop_is_found_and_an_equal_policy_is_equivalent():
    lines = accuracy_page.lines(accuracy_rows(np.random.default_rng(0)))
    at = next(line for line in lines if line.startswith("Ours: recall at budget 0.1: h2o"))
    # identical answers on 200 items: no change, and an interval only as narrow as 200 items can resolve
    assert ": lower" in at and "infinigen" in at and "(+0.0 pp, interval -3.9 to +3.9: equivalent)" in at
    assert any("the 3 intervals of multiple choice spend its 1.25% of the page's error rate (Bonferroni: each at "
               "99.58%)" in line for line in lines)


def test_retention_pairs_questions_and_resamples_conversations():
    rng = np.random.default_rng(1)
    rows = []
    for bucket in ("1K-2K", "2K-4K"):
        for conv in range(20):
            kept = rng.random() < 0.7  # H2O keeps the fact for a whole conversation or loses it: ~30 pp lower
            for turn in (2, 4, 6):
                for policy, correct in (("full", True), ("h2o", kept), ("infinigen", True)):
                    rows.append({"policy": policy, "budget": None if policy == "full" else 0.3, "bucket": bucket,
                                 "conversation": f"{bucket}-{conv}", "turn": turn, "correct": correct})
    lines = retention_page.lines(pd.DataFrame(rows))
    assert any("120 questions per policy" in line and "in 40 conversations" in line for line in lines)
    assert any(line.startswith("Ours: h2o at budget 0.3 answers") and ": " not in line.split("answers")[1]
               for line in lines)  # described, no verdict word: the page's tested statements are finding 5's
    # no conversation differs, yet 40 conversations cannot show a difference under 5 pp: inconclusive, not
    # "equivalent", and the reach line says from how many conversations it would come out confirmed with 80 % power
    # if InfiniGen lost the middle of the paper's 1-4 pp
    assert any(line.startswith("Ours, finding 5 (as deployed): infinigen within +-5 pp") and "inconclusive" in line
               for line in lines)
    from kvlib.report.claims import units_needed
    from kvlib.report.pages import FINDINGS

    level = FINDINGS.level("finding 5")
    floor, needed = stats.resolution(40, level), units_needed(level, -0.05, 0.05, 0.025)
    assert any(f"40 conversations here (no interval narrower than +-{floor * 100:.1f} pp), about {needed:,} "
               "conversations to confirm it with 80% power if InfiniGen loses 2.5 pp" in line for line in lines)
    assert any(line.startswith("Ours, finding 5 (as deployed): h2o worse with longer contexts") for line in lines)



def test_the_retention_table_never_pools_two_protocols():
    from kvlib.report.retention import table as retention_table

    rows = pd.DataFrame([{"policy": "h2o", "protocol": protocol, "correct": correct}
                         for protocol, correct in (("deployed", True), ("deployed", True), ("strict", False))])
    table = retention_table(rows)
    assert table.loc[("h2o", "deployed"), "score"] == 1.0 and table.loc[("h2o", "strict"), "score"] == 0.0
    assert table.loc[("h2o", "deployed"), "items"] == 2
