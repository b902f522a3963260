"""Finding 4's losses across model sizes (kvlib.report.accuracy.paper_sizes): each model's task-average drops over
the tasks every model's full cache passes, the slope of the loss at 0.1 against log10(parameters) with its interval,
and the sentence on what carries to 8B following the slope's word."""

import math

import numpy as np
import pandas as pd
import pytest
from paper_rows import NAN, paper_frame  # tests/helpers

from kvlib.report.accuracy import lines
from kvlib.report.accuracy import paper_sizes as sizes
from kvlib.report.accuracy.paper_beside import accuracy_claims
from kvlib.report.accuracy.paper_tasks import paper_rows, reading_model
from kvlib.report.stats.slope import slope
from kvlib.study.reference import Borrowed

MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
TASKS = ("piqa", "winogrande", "copa")


def frame(losses_at_01, items=400, full_shares=None, tasks=TASKS):
    """One model's rows per entry of `losses_at_01` (H2O and InfiniGen lose that share at 0.1, nothing at 0.5)."""
    def points(loss):
        return {("h2o", 0.5, "flexgen", NAN): 0.0, ("infinigen", 0.5, NAN, 5.0): 0.0,
                ("h2o", 0.1, "flexgen", NAN): loss, ("infinigen", 0.1, NAN, 5.0): loss}

    return pd.concat([paper_frame(items=items, tasks=tasks, model=model, seed=i, points=points(loss),
                                  full_shares=(full_shares or {}).get(model))
                      for i, (model, loss) in enumerate(zip(MODELS, losses_at_01))], ignore_index=True)


def test_a_slope_is_the_least_squares_line_and_carries_each_groups_floor():
    reps = [np.array([0.1, 0.3]), np.array([0.0, 0.0])]
    estimate, low, high = slope([0.0, 1.0], [0.2, 0.0], reps, [0.0, 0.0], 0.5)
    # the replicates' slopes are -0.1 and -0.3: their 25th and 75th percentiles
    assert (estimate, low, high) == pytest.approx((-0.2, -0.25, -0.15))
    estimate, low, high = slope([0.0, 1.0], [0.2, 0.0], [np.full(2, 0.2), np.zeros(2)], [0.1, 0.1], 0.95)
    assert high - estimate == pytest.approx(math.hypot(0.1, 0.1))  # no spread: the floors alone
    assert math.isnan(slope([1.0], [0.2], [np.zeros(2)], [0.0], 0.95)[0])


def test_a_loss_that_shrinks_with_size_reads_shrinks_and_carries_no_bound():
    df = frame([0.30, 0.15, 0.0])
    table = sizes.drops(df, 0.7)
    assert set(table["model"]) == set(MODELS) and set(table["budget"]) == {0.5, 0.1}
    at = table[(table["policy"] == "h2o") & (table["budget"] == 0.1)].set_index("model")["drop"]
    assert at["smollm2-135m"] == pytest.approx(0.30)  # round(0.3 x items) items lost on each task
    for policy in sizes.POLICIES:
        t = sizes.trend(df, 0.7, policy)
        assert t.word == sizes.SHRINKS and t.high < 0 and t.models[0] == "SmolLM2-135M-Instruct"
    said = sizes.carry(df, 0.7)
    assert "shrinks with model size" in said and "no bound" in said and "5.2x" in said


def test_a_loss_that_grows_reads_grows_and_one_alike_reads_no_trend():
    assert sizes.trend(frame([0.0, 0.15, 0.30]), 0.7, "infinigen").word == sizes.GROWS
    alike = frame([0.1, 0.1, 0.1])
    assert sizes.trend(alike, 0.7, "h2o").word == sizes.NOT_SHOWN
    said = sizes.carry(alike, 0.7)
    assert "in neither direction" in said and "h2o's loss at 0.1 shows no trend with model size (" in said


def test_a_task_beyond_one_model_leaves_every_models_average():
    """A task the smallest model's full cache answers at chance is left out for all three, so that every model's
    average reads the same tasks (its 100 % loss on the other models does not move theirs)."""
    df = frame([0.1, 0.1, 0.1], full_shares={"smollm2-135m": {"copa": 0.5}})
    lost = df[(df["task"] == "copa") & (df["policy"] != "full") & (df["budget"] == 0.1)].index
    df.loc[lost, "correct"] = 0.0
    _, tasks = sizes.sized_rows(df, 0.7)
    assert tasks == ["piqa", "winogrande"]
    assert sizes.trend(df, 0.7, "h2o").word == sizes.NOT_SHOWN


def test_three_models_without_a_task_all_pass_give_no_trend_and_say_why():
    df = frame([0.3, 0.15, 0.0], full_shares={"smollm2-135m": {t: 0.5 for t in TASKS}})
    assert sizes.sized_rows(df, 0.7)[1] == [] and sizes.trend(df, 0.7, "h2o") is None
    said = sizes.carry(df, 0.7)
    assert "no task's full cache is above chance on every one of them" in said and "in neither direction" in said


def test_one_model_gives_no_trend_and_says_nothing_carries():
    df = frame([0.2])
    assert sizes.drops(df, 0.7).empty and sizes.trend(df, 0.7, "h2o") is None
    assert "neither direction" in sizes.carry(df, 0.7) and sizes.lines(df, 0.7) == []


def test_a_model_of_unknown_size_is_left_off_the_axis():
    df = frame([0.3, 0.0])
    df.loc[df["model"] == "qwen2.5-coder-0.5b", "model"] = "meta-llama/Llama-3.1-8B"
    assert sizes.trend(df, 0.7, "h2o") is None
    assert not sizes.has_sizes(df)


def test_rows_have_sizes_from_two_models_of_known_size_with_a_full_cache():
    assert sizes.has_sizes(frame([0.3, 0.0])) and not sizes.has_sizes(frame([0.3]))
    two = frame([0.3, 0.0])
    assert not sizes.has_sizes(two[(two["model"] == MODELS[0]) | (two["policy"] != "full")])
    assert not sizes.has_sizes(pd.DataFrame())


def test_the_size_section_reads_its_own_rows_where_they_hold_a_trend_or_the_papers_model():
    """Another book's small-model trend is borrowed only where these rows hold neither: on the paper's own model the
    section says so, instead of carrying the small models' trend to it."""
    assert sizes.reads_own(frame([0.3, 0.0])) and not sizes.reads_own(frame([0.3]))
    llama = frame([0.2]).assign(model="meta-llama/Llama-3.1-8B-Instruct")
    assert sizes.reads_own(llama) and not sizes.has_sizes(llama)
    assert sizes.carry(llama, 0.7).startswith("These rows read the paper's tasks on its own model")
    assert not sizes.reads_own(pd.DataFrame())


def test_the_trend_stands_beside_finding_4s_verdict_never_in_it():
    df = frame([0.30, 0.15, 0.0])
    claims = accuracy_claims(df, 0.7)
    assert any("across model sizes" in line for line in claims.context)
    assert not any("model size" in c.name for c in claims.claims)
    alone = accuracy_claims(df[df["model"] == reading_model(paper_rows(df))], 0.7)
    assert [c.verdict for c in claims.claims] == [c.verdict for c in alone.claims]  # the verdict reads one model


def test_the_figure_names_each_model_on_its_axis():
    import matplotlib

    matplotlib.use("Agg")
    fig = sizes.plot(frame([0.30, 0.15, 0.0], items=100), 0.7)
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels == ["SmolLM2-135M\n0.13B", "Qwen2.5-Coder-0.5B\n0.49B", "Qwen2.5-Coder-1.5B\n1.5B"]
    assert [ax.get_title() for ax in fig.axes] == ["budget 0.5", "budget 0.1"]
    assert sizes.plot(frame([0.2], items=100), 0.7) is None


def test_the_chapters_lead_carries_what_its_size_section_reads_another_books_rows_named():
    """One model's rows say nothing of size; where the size section reads another book's three (reference.rows_for),
    the lead carries that book's trend toward 8B and names it."""
    ours = frame([0.2])
    assert "neither direction" in lines.lead(ours, 0.7)
    theirs = Borrowed(frame([0.30, 0.15, 0.0]), 0.7, "its note", "confirmatory")
    said = lines.lead(ours, 0.5, sizes=theirs)
    assert "From the confirmatory reference book's rows" in said and "shrinks with model size" in said
    assert sizes.carry(theirs.rows, 0.7) in said and "neither direction" not in said
    assert lines.lead(ours, 0.7, sizes=Borrowed(ours, 0.7)) == lines.lead(ours, 0.7)  # its own rows: no book named
