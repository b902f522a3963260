"""Each interval a page prints names its level and is no narrower than its units resolve: the retention chapter's
full-cache score from 40 conversations all answered right once printed "95 % interval 100%-100%" (a bootstrap of
identical answers has no spread), against the methods' floor; the overview figure names the level of the drops it
shows beside a page whose claims are at their family's."""

import re

import pandas as pd

from kvlib.report import retention as retention_page
from kvlib.report import stats
from kvlib.report.findings.overview import overview
from kvlib.report.study_rows import StudyRows


def retention_rows(conversations=40):
    return pd.DataFrame([{"policy": p, "budget": None if p == "full" else 0.3, "bucket": ("1K-2K", "2K-4K")[c % 2],
                          "conversation": f"c{c}", "turn": t, "correct": p == "full" or c % 3 > 0,
                          "protocol": "deployed"}
                         for c in range(conversations) for t in (2, 12) for p in ("full", "h2o", "infinigen")])


def test_a_retention_score_all_right_is_no_narrower_than_its_conversations_resolve():
    line = next(x for x in retention_page.lines(retention_rows(), gate=0.7) if "the full cache answers" in x)
    level = 1 - stats.ALPHA
    found = re.search(rf"in 40 conversations; {level * 100:g} % interval (\d+)%-(\d+)%", line)
    assert found, line
    assert int(found.group(1)) == round(100 * (1 - stats.resolution(40, level))) < 100, line


def test_the_overview_names_its_intervals_level():
    batch = pd.DataFrame([{"policy": p, "batch_size": 8, "repeat": r, "oom": False, "decode_tokens_per_s": tps,
                           "device_peak_bytes": 2**30, "lossless": p == "full", "budget": None if p == "full" else 0.3}
                          for p, tps in (("full", 100.0), ("h2o", 130.0)) for r in range(4)])
    accuracy = pd.DataFrame([{"task": "recall", "policy": p, "budget": None if p == "full" else 0.3, "doc_id": i,
                              "correct": float(p == "full" or i >= 20)} for p in ("full", "h2o") for i in range(60)])
    title = overview(StudyRows(batch_scaling=batch, accuracy=accuracy)).axes[0].get_title()
    assert f"its {(1 - stats.ALPHA) * 100:g} % interval (described, not tested: unadjusted)" in title, title
