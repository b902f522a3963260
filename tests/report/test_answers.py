"""Each chapter opens with sentences generated from its results: the lead by geometric mean with the timing rule's
interval, where memory ran out, the paired drops that matter; and the findings page's overview figure draws every
runner from the same frames."""

import numpy as np
import pandas as pd
from chapter_rows import accuracy_rows, batch_rows  # tests/helpers
from paper_rows import paper_frame

from kvlib.report import opening
from kvlib.report.findings.overview import overview
from kvlib.report.study_rows import StudyRows
from kvlib.study import experiment


def test_batch_scaling_opens_with_the_lead_its_interval_and_where_memory_ran_out():
    text = experiment("batch_scaling").answer(batch_rows())
    assert text.startswith("**In short.** At batch 8, h2o decodes fastest (")  # told from paged by the rule
    assert "1.29x paged's throughput (interval" in text  # 8 rounds, paired: an interval exists
    assert "Throughput per GiB of device memory (geometric mean over the booked peak, tok/s per GiB): full" in text
    assert "Out of device memory: kivi from batch 8." in text


def test_a_lead_is_worded_by_its_verdict():
    """Words follow verdicts: two runners the timing rule cannot tell apart are named together, never ranked."""
    rows = batch_rows()
    paged = rows.loc[rows["policy"] == "paged"]
    rows.loc[rows["policy"] == "h2o", "decode_tokens_per_s"] = (paged["decode_tokens_per_s"]
                                                                * (1 + 0.02 * (-1) ** paged["repeat"])).to_numpy()
    text = experiment("batch_scaling").answer(rows)
    assert "decodes fastest" not in text and "paged and h2o are not distinguishable: paged" in text
    two = batch_rows()
    two = two[two["repeat"] < 2]  # 2 rounds: no interval at all
    assert "are not told apart at 2 repeats" in experiment("batch_scaling").answer(two)
    one = batch_rows()
    assert "are not told apart at 1 repeat:" in experiment("batch_scaling").answer(one[one["repeat"] < 1])


def test_accuracy_opens_with_the_paired_drops_of_the_papers_two_methods():
    text = experiment("accuracy").answer(accuracy_rows())
    assert "On the book's recall (the full cache 100.0% over 60 items, kvlib's deployed protocol)" in text
    # the multiple-choice section's 1.25 % of the page (the page's error rate is said under the lead)
    assert "h2o at 0.1 -50.0 pp, interval -66.7 to -31.7: lower" in text and "**One error rate for this page.**" in text
    assert "h2o at 0.5 +0.0 pp, interval" in text


def test_a_chapter_with_no_results_says_so():
    assert experiment("decode_length").answer(pd.DataFrame()) == f"**In short.** {opening.NOTHING}"


def test_the_overview_draws_every_runner_with_its_accuracy():
    fig = overview(StudyRows(batch_scaling=batch_rows(), accuracy=accuracy_rows()))
    assert sorted(t.get_text() for t in fig.axes[0].texts) == ["full", "h2o", "paged"]  # kivi ran out of memory
    key = sorted(t.get_text() for t in fig.legends[0].get_texts())
    assert key[0] == "full: keeps every entry" and key[2] == "paged: keeps every entry"
    assert key[1].startswith("h2o: -50.0 pp (")  # the drop at 0.1, the nearest scored budget below its 0.3
    assert key[1].endswith("at budget 0.1; speed and memory measured at budget 0.3")  # two budgets, each named
    assert fig.axes[1].get_ylabel() == "accuracy lost against the full cache (pp)"


def test_a_profile_without_batch_scaling_gets_a_sentence_not_an_empty_overview(capsys):
    """The confirmatory profile runs accuracy and retention alone: its findings page drew a pair of empty axes."""
    assert overview(StudyRows(batch_scaling=pd.DataFrame(), accuracy=accuracy_rows())) is None
    assert capsys.readouterr().out.startswith("No overview figure: this profile has no batch-scaling results")


def test_the_overviews_names_cover_neither_each_other_nor_a_point_when_runners_crowd():
    rows = batch_rows()
    full = rows[rows["policy"] == "full"]
    crowd = [full.assign(policy=f"runner{i}", device_peak_bytes=(1.0 + 0.01 * i) * 2**30,
                         decode_tokens_per_s=full["decode_tokens_per_s"] * (1 + 0.01 * (i % 4))) for i in range(13)]
    fig = overview(StudyRows(batch_scaling=pd.concat(crowd)))
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in ax.texts]
    assert len(boxes) == 13
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    dots = ax.transData.transform(np.concatenate([c.get_offsets() for c in ax.collections if len(c.get_offsets())]))
    assert not any(b.contains(x, y) for b in boxes for x, y in dots)


def test_a_compressed_runners_accuracy_is_no_evidence_for_it_run_uncompressed():
    """FlexGen + H2O's accuracy was measured in 4 bits; the systems rows ran it uncompressed: no drop is drawn for
    it there (its 4-bit drop says nothing of its uncompressed cache), and the chooser reads the same evidence."""
    from kvlib.report.choose.evidence import accuracy_evidence, compressed, compressed_apart, evidence_for

    batch = batch_rows().assign(compress_cache=False)
    accuracy = accuracy_rows().assign(compress_cache=lambda d: d["policy"] == "h2o")
    assert compressed(batch) == {"full": False, "h2o": False, "kivi": False, "paged": False}
    assert accuracy_evidence(accuracy, {"h2o": 0.3}, compression=compressed(batch)) == {}
    assert "h2o" in accuracy_evidence(accuracy, {"h2o": 0.3}, compression={"h2o": True})
    assert evidence_for(accuracy, batch) == {}  # the systems rows' own settings: uncompressed
    assert "h2o" in evidence_for(accuracy, batch.assign(compress_cache=batch["policy"] == "h2o"))
    fig = overview(StudyRows(batch_scaling=batch, accuracy=accuracy))
    assert "h2o: accuracy not measured as run here" in {t.get_text() for t in fig.legends[0].get_texts()}
    assert compressed_apart(accuracy, batch) == {"h2o"}  # the chooser says why: measured, but compressed otherwise
    assert compressed_apart(accuracy, batch.assign(compress_cache=batch["policy"] == "h2o")) == set()


def test_the_paper_tasks_lead_the_accuracy_answer_as_drops_never_as_verdicts():
    """The accuracy page's lead reads finding 4's task averages first, described: the verdict words are the findings
    page's, in its family, and the paper's rows never enter the page's own multiple-choice section."""

    paper = paper_frame(items=40)
    text = experiment("accuracy").answer(pd.concat([paper, accuracy_rows()], ignore_index=True))
    lead = text.split("On the book's recall")[0]
    assert lead.startswith("**In short.** On the paper's six tasks (the official harnesses' one-pass protocol")
    assert "infinigen at budget 0.1 loses ~6 pp on the task average" in lead
    assert not any(word in lead for word in (": confirmed", ": refuted", ": inconclusive", ": lower", ": equivalent"))
    alone = experiment("accuracy").answer(accuracy_rows())
    assert text.split("On the book's recall")[1].split("(paired).")[0] == \
        alone.split("On the book's recall")[1].split("(paired).")[0]
