"""The chooser, on a small synthetic results frame whose right answers are known by construction."""

import pandas as pd
import pytest
from chooser_frames import frames

from kvlib.report.choose.regimes import REGIME, by_question, largest_workload, regimes
from kvlib.report.choose.workload import choose, read_at
from kvlib.report.study_rows import StudyRows

GIB = 2**30


def test_read_at_interpolates_inside_the_grid_and_never_past_it():
    curve = pd.Series({1: 10.0, 4: 40.0})
    assert read_at(curve, 2, "batch").value == pytest.approx(20.0) and read_at(curve, 2, "batch").points == [1, 4]
    beyond = read_at(curve, 16, "batch")
    assert beyond.value == 40.0 and beyond.beyond_grid and "not extrapolated" in beyond.how("tokens/s")


def test_the_fastest_policy_that_fits_and_keeps_its_accuracy():
    f = frames()
    assert choose(StudyRows(**f), 512, 4, 32).fastest_decode == "fast"
    at8 = choose(StudyRows(**f), 512, 8, 32)  # fast ran out of memory at 8: not a candidate there
    assert at8.fastest_decode == "sparse" and "does not fit at batch 8" in at8.excluded["fast"]
    # sparse loses 4 items of 50 at 0.1, the budget below its 0.3: a measured 8 pp, interval ~1-16 pp. At 5 or 10 pp
    # that is neither within the tolerance nor beyond it: "cannot tell", never "ruled out" for want of items
    for tolerance in (5.0, 10.0):
        c = choose(StudyRows(**f), 512, 8, 32, max_accuracy_drop=tolerance)
        assert c.fastest_decode == "full" and "sparse" not in c.excluded and "sparse" not in c.decode
        why = c.undecided["sparse"]
        assert why.startswith(f"cannot tell at 50 items whether it stays within {tolerance:g} pp: the 98.8% interval spans")
        assert "measured drop 8.0 pp" in why and "nearest scored budget below 0.3" in why
        assert "items would resolve it" in why and f"Not ranked: sparse: {why}." in c.text()
    assert choose(StudyRows(**f), 512, 8, 32, max_accuracy_drop=20.0).fastest_decode == "sparse"  # the interval's top is ~16 pp
    lossy = f["accuracy"].copy()
    lossy.loc[(lossy["policy"] == "sparse") & (lossy["doc_id"] < 20), "correct"] = 0.0  # 40 pp lost at either budget
    ruled = choose(StudyRows(**{**f, "accuracy": lossy}), 512, 8, 32, max_accuracy_drop=5.0)
    assert "sparse" not in ruled.undecided and ruled.excluded["sparse"].startswith("loses more than the 5 pp allowed")
    # the validity gate: a task the full cache fails says nothing about the policies
    failed = f["accuracy"].assign(correct=lambda d: d["correct"] * (d["doc_id"] % 2))
    gated = choose(StudyRows(**{**f, "accuracy": failed}), 512, 8, 32, max_accuracy_drop=5.0)
    assert "a task the full cache passes" in gated.unmeasured["sparse"] and "sparse" not in gated.excluded
    assert "Not measured: sparse: its accuracy was not measured" in gated.text()
    small = choose(StudyRows(**f), 512, 4, 32, device_memory_gb=2.5)  # fast's measured peak at batch 4 is 3 GiB
    assert small.fastest_decode == "sparse" and "fast" in small.excluded


def test_lowest_ttft_at_the_fastest_prefill_mode_interpolated_between_lengths():
    c = choose(StudyRows(**frames()), 1024, 4, 32)
    assert c.lowest_ttft == "sparse"
    assert c.ttft["sparse"].value == pytest.approx(0.5 * 1.024) and c.ttft["sparse"].points == [512, 2048]
    assert "interpolated between prompt tokens 512 and 2048" in c.text()


def test_the_regimes_table_is_computed_by_the_same_function():
    table = regimes(StudyRows(**frames()), tolerances=(None, 5.0))
    assert len(table) == 2 * 2 * 2 * 1 * 2  # memories x prompts x batches x (no decode-length grid) x tolerances
    at = table[table["device memory (GiB)"] == "profile's"]
    row = at[(at["batch"] == 8) & (at["accuracy drop allowed (pp)"] == "5")].iloc[0]
    assert row["fastest decode"].startswith("full") and "sparse" in row["cannot tell"]
    tables = by_question(table)  # the chapter's one table a question: every column once, each row a regime
    assert sorted(c for t in tables.values() for c in t.columns) == sorted(set(table.columns) - set(REGIME))
    assert all(t.index.to_frame(index=False).equals(table[REGIME]) for t in tables.values())


def test_the_chapter_answers_for_the_largest_workload_and_a_profile_without_systems_results_still_gets_an_answer():
    assert largest_workload(StudyRows(**frames())).text() == choose(StudyRows(**frames()), 2048, 8, 32, 5.0).text()
    only_accuracy = {"accuracy": frames()["accuracy"], "batch_scaling": pd.DataFrame(), "ttft": pd.DataFrame()}
    answer = largest_workload(StudyRows(**only_accuracy))  # the confirmatory profile measures no decode and no TTFT
    assert answer.fastest_decode is None and answer.lowest_ttft is None and answer.text()


def test_the_regimes_table_has_a_device_memory_where_only_some_runners_fit():
    """At batch 8 full peaks at 3 GiB and sparse at 2 (fast ran out): the tight memory is their median, 2.5 GiB, where
    only sparse fits, and it answers though it is lossy when any accuracy drop is allowed."""
    table = regimes(StudyRows(**frames()), tolerances=(None,))
    tight = table[table["device memory (GiB)"] == "2.5"]
    row = tight[tight["batch"] == 8].iloc[0]
    assert row["fastest decode"].startswith("sparse") and "full" in row["ruled out"]


def test_a_prompt_length_fits_when_any_prefill_mode_fits_and_a_ruled_out_policy_is_in_no_answer():
    f = frames()
    ttft = f["ttft"].copy()
    ttft.loc[(ttft["prompt_tokens"] == 2048) & (ttft["prefill"] == "full"), "oom"] = True  # fused still fits
    ttft.loc[(ttft["policy"] == "fast") & (ttft["prompt_tokens"] == 2048), "oom"] = True  # nothing fits for fast
    c = choose(StudyRows(**{**f, "ttft": ttft}), 2048, 4, 32)
    assert "full" not in c.excluded and c.ttft["full"].value == pytest.approx(2.048)
    assert "does not fit at prompt tokens 2048" in c.excluded["fast"]
    assert "fast" not in c.decode and c.fastest_decode == "sparse"


def test_the_fastest_decode_is_chosen_among_policies_of_one_kernel():
    f = frames()
    batch = f["batch_scaling"].copy()
    batch.loc[batch["policy"] == "fast", "stat_decode_attention"] = "torch"  # the fastest ran another kernel
    c = choose(StudyRows(**{**f, "batch_scaling": batch}), 512, 4, 32)
    assert c.fastest_decode == "sparse" and "fast" not in c.decode
    assert any("torch: fast" in note and "chosen among those that ran `c`" in note for note in c.notes)


def test_results_that_do_not_record_their_kernel_are_not_the_ones_chosen_among():
    f = frames()
    batch = f["batch_scaling"].copy()
    batch.loc[batch["policy"] != "full", "stat_decode_attention"] = None  # results from before every policy said
    c = choose(StudyRows(**{**f, "batch_scaling": batch}), 512, 4, 32)
    assert c.fastest_decode == "full" and set(c.decode) == {"full"}


def test_a_preallocating_engine_below_its_pool_is_not_measured_at_that_capacity():
    """vLLM books its whole pool as its peak: below the memory it was measured with it would start with a smaller
    pool, not fail; the chooser says it was not measured there, never that it does not fit."""
    f = frames()
    vllm = f["batch_scaling"][f["batch_scaling"]["policy"] == "full"].assign(
        policy="vllm (real)", outside=True, device_peak_bytes=3.5 * GIB, device_kv_reserved_peak_bytes=2 * GIB)
    batch = pd.concat([f["batch_scaling"].assign(outside=False, device_kv_reserved_peak_bytes=0), vllm])
    c = choose(StudyRows(**{**f, "batch_scaling": batch}), 512, 4, 32, device_memory_gb=3.0)
    assert c.unmeasured_capacity["vllm (real)"].startswith("it preallocates its KV pool")
    assert "vllm (real)" not in c.excluded and "vllm (real)" not in c.decode
    assert "Not measured at this capacity: vllm (real): it preallocates" in c.text() and "Ruled out: vllm" not in c.text()
    assert "vllm (real)" in choose(StudyRows(**{**f, "batch_scaling": batch}), 512, 4, 32).decode  # at the profile's capacity


def test_the_answer_names_the_policies_it_cannot_be_told_from():
    """A lead inside the noise is no lead: the policies whose repeats the findings' permutation rule cannot tell from
    the answer's at the grid point read are named; one clearly slower is not, nor an interpolated figure."""
    jitters = [0.0, 30.0, -30.0, 15.0, -15.0, 5.0, -5.0, 10.0]  # 8 rounds: enough to tell one slower at 2.5 %
    rows = [{"policy": p, "lossless": True, "batch_size": b, "oom": False, "decode_tokens_per_s": base * b + jitter,
             "device_peak_bytes": GIB, "min_prompt_tokens": 128, "max_prompt_tokens": 1024, "max_new_tokens": 32,
             "budget": None, "repeat": r, "stat_decode_attention": "c"}
            for p, base, order in [("a", 100.0, 1), ("twin", 99.0, -1), ("slow", 50.0, 1)] for b in (1, 4)
            for r, jitter in enumerate(jitters[::order])]
    f = {"batch_scaling": pd.DataFrame(rows), "ttft": frames()["ttft"]}
    c = choose(StudyRows(**f), 512, 4, 32)
    assert c.fastest_decode == "a" and c.decode_ties == ["twin"]
    assert "Not distinguishable from it there (allowing for its pick among them): twin." in c.text()
    between = choose(StudyRows(**f), 512, 2, 32)  # interpolated between batch 1 and 4: no repeats of its own
    assert between.decode_ties == [] and "Untested: a figure read between or beyond grid points" in between.text()
    row = regimes(StudyRows(**f), tolerances=(None,)).query("batch == 4").iloc[0]
    assert row["fastest decode"].startswith("a (") and row["decode, not distinguishable"] == "twin"
    assert "TTFT: not measured for a, slow, twin in this profile's TTFT grid" in c.text()


def test_an_answer_is_one_family_with_declared_shares():
    """Each answer spends 5 % in declared shares: its accuracy intervals share a quarter (each at that quarter over
    as many intervals as the rows could give), its decode ties half, its TTFT ties a quarter; the answer says so."""
    from kvlib.report import stats
    from kvlib.report.choose.evidence import evidence_for
    from kvlib.report.pages import CHOOSER

    assert sum(CHOOSER.share(name) for name, _ in CHOOSER.weights) == pytest.approx(stats.ALPHA)
    f = frames()
    one = evidence_for(f["accuracy"], f["batch_scaling"], page=CHOOSER)
    assert one["sparse"][0].drop.level == pytest.approx(1 - CHOOSER.share("accuracy"))
    # a second lossy policy scored on the task: two intervals the rows could give, each at half the quarter
    other = f["accuracy"][f["accuracy"]["policy"] == "sparse"].assign(policy="other")
    two = evidence_for(pd.concat([f["accuracy"], other]), f["batch_scaling"], page=CHOOSER)
    assert two["sparse"][0].drop.level == pytest.approx(1 - CHOOSER.share("accuracy") / 2)
    assert evidence_for(f["accuracy"], f["batch_scaling"])["sparse"][0].drop.level == pytest.approx(0.95)
    text = choose(StudyRows(**f), 512, 4, 32, max_accuracy_drop=5.0).text()
    assert "at most 5%: 1.25% to the accuracy intervals" in text and "ties at 2.50% and 1.25%, each a max-T over the candidates" in text
    assert f"{1 - CHOOSER.share('accuracy'):.1%} interval" in choose(StudyRows(**f), 512, 4, 1, max_accuracy_drop=1.0).text()


def test_the_ties_are_read_at_the_answers_share_for_decode():
    """One clearly slower rival over 6 rounds: its by-round p-value is 2 / 64 = 3.1 %, below 5 % (a test at 5 % for
    the answer alone would tell it slower) but above the decode share, 2.5 %: so it is named not distinguishable.
    The answer's family is what decides it."""
    jitters = [0.0, 3.0, -3.0, 1.5, -1.5, 0.5]
    rows = [{"policy": p, "lossless": True, "batch_size": b, "oom": False, "decode_tokens_per_s": base * b + jitter,
             "device_peak_bytes": GIB, "min_prompt_tokens": 128, "max_prompt_tokens": 1024, "max_new_tokens": 32,
             "budget": None, "repeat": r, "stat_decode_attention": "c"}
            for p, base in [("a", 100.0), ("b", 50.0)] for b in (1, 4) for r, jitter in enumerate(jitters)]
    c = choose(StudyRows(batch_scaling=pd.DataFrame(rows)), 512, 4, 32)
    assert c.fastest_decode == "a" and c.decode_ties == ["b"]
    from kvlib.report.stats.best import compare_with_best

    runs = pd.DataFrame({p: [r["decode_tokens_per_s"] for r in rows if r["policy"] == p and r["batch_size"] == 4]
                         for p in "ab"}).rename_axis("round")
    assert compare_with_best(runs, "a", 0.05).slower == ("b",)  # at 5 % for the answer alone, told apart
