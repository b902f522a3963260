"""Each chapter opens with sentences generated from its results: the lead by geometric mean with the timing rule's
interval, where memory ran out, the paired drops that matter; and the findings page's overview figure draws every
runner from the same frames."""

import numpy as np
import pandas as pd

from kvlib.report import answers, plots


def batch_rows():
    rows = []
    for policy, tps, peak, lossless, budget in [("full", 100.0, 2.0, True, None), ("h2o", 130.0, 1.0, False, 0.3),
                                                ("paged", 101.0, 2.0, True, None)]:
        for batch in (1, 8):
            for r in range(8):
                rows.append({"policy": policy, "batch_size": batch, "repeat": r, "oom": False,
                             "decode_tokens_per_s": tps * batch * (1 + 0.01 * ((r * 7) % 5 - 2)),
                             "device_peak_bytes": peak * 2**30, "host_peak_bytes": 0, "lossless": lossless,
                             "budget": budget, "stat_decode_attention": "c"})
    rows.append({"policy": "kivi", "batch_size": 8, "repeat": 0, "oom": True, "decode_tokens_per_s": np.nan,
                 "device_peak_bytes": np.nan, "host_peak_bytes": np.nan, "lossless": False, "budget": None})
    return pd.DataFrame(rows)


def accuracy_rows():
    rows = [{"task": "recall", "policy": "full", "budget": None, "doc_id": i, "correct": 1.0} for i in range(60)]
    rows += [{"task": "recall", "policy": "h2o", "budget": b, "doc_id": i, "correct": float(i >= lost)}
             for b, lost in ((0.1, 30), (0.5, 0)) for i in range(60)]
    return pd.DataFrame(rows)


def test_batch_scaling_opens_with_the_lead_its_interval_and_where_memory_ran_out():
    text = answers.answer("batch_scaling", batch_rows())
    assert text.startswith("**In short.** At batch 8, h2o decodes fastest by geometric mean (")
    assert "1.29x paged's throughput (interval" in text  # 8 rounds, paired: an interval exists
    assert "The most throughput per GiB of device memory: h2o" in text
    assert "Out of device memory: kivi from batch 8." in text


def test_accuracy_opens_with_the_paired_drops_of_the_papers_two_methods():
    text = answers.answer("accuracy", accuracy_rows())
    assert "On recall (the full cache 100.0% over 60 items)" in text
    assert "h2o at 0.1 -50.0 pp, interval -65.0 to -35.0: lower" in text
    assert "h2o at 0.5 +0.0 pp, interval" in text


def test_a_chapter_with_no_results_says_so():
    assert answers.answer("decode_length", pd.DataFrame()) == f"**In short.** {answers.NOTHING}"


def test_the_overview_draws_every_runner_with_its_accuracy():
    fig = plots.overview({"batch_scaling": batch_rows(), "accuracy": accuracy_rows()})
    labels = sorted(t.get_text() for t in fig.axes[0].texts)
    assert labels[0] == "full: keeps every entry" and labels[2] == "paged: keeps every entry"
    assert labels[1].startswith("h2o: -50.0 pp (")  # the drop at 0.1, the nearest scored budget below its 0.3
    assert len(labels) == 3  # kivi ran out of memory at the reference batch: not drawn
    assert fig.axes[1].get_ylabel() == "accuracy lost against the full cache (pp)"
