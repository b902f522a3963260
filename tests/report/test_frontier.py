"""The accuracy-memory frontier (kvlib.report.accuracy.frontier): hybrids against the uniform policy that lost least, item by
item, with the bytes each held."""

import math

import pandas as pd
import pytest
from chapter_rows import item_rows  # tests/helpers

from kvlib.report import stats
from kvlib.report.accuracy import frontier
from kvlib.report.pages import ACCURACY


@pytest.fixture
def results():
    return pd.DataFrame(
        item_rows("full", math.nan, set(), 1.0)
        + item_rows("h2o", 0.1, set(range(30)), 0.1)
        + item_rows("snapkv", 0.1, set(range(20)), 0.11)
        + item_rows("streaming", 0.1, set(range(60)), 0.1)
        + item_rows("adakv", 0.1, set(range(3)), 0.11)  # loses 3 of snapkv's 20
        + item_rows("duo", 0.1, set(range(50)), 0.12)  # loses snapkv's 20 and 30 more
        + item_rows("pyramidkv", 0.1, set(range(1, 21)), 0.11)  # snapkv's count, on other items but one
        + item_rows("quest", 0.1, set(range(5)), 1.0))


def test_a_hybrid_that_held_more_is_said_not_to_be_at_equal_bytes(results):
    more = results.assign(kv_share_held=results["kv_share_held"].where(results["policy"] != "duo", 0.5))
    text = "\n".join(frontier.lines(more))
    assert "holding 50.0% of the full cache's KV bytes per token against 11.0% (not equal bytes" in text


def test_the_uniform_policy_compared_held_the_hybrids_bytes_where_one_did(results):
    """snapkv loses least, but held twice adakv's bytes here: h2o, at adakv's, is the one compared."""
    d = results.assign(kv_share_held=results["kv_share_held"].where(results["policy"] != "snapkv", 0.22))
    assert ("kvlib_recall", 0.1, "adakv", "h2o") in frontier.comparisons(d)


def test_each_hybrid_is_read_against_the_uniform_policy_that_lost_least(results):
    drops = frontier.comparisons(results)
    assert set(drops) == {("kvlib_recall", 0.1, h, "snapkv") for h in ("adakv", "duo", "pyramidkv")}
    adakv, duo, pyramid = (drops[("kvlib_recall", 0.1, h, "snapkv")] for h in ("adakv", "duo", "pyramidkv"))
    assert adakv.drop == pytest.approx(-0.17) and adakv.verdict == stats.HIGHER  # it scores higher: loses less
    assert duo.drop == pytest.approx(0.30) and duo.verdict == stats.LOWER
    assert pyramid.drop == pytest.approx(0.0) and pyramid.verdict == stats.INCONCLUSIVE  # 2 items differ, not 0
    assert all(d.paired and d.level == pytest.approx(stats.family_level(3, ACCURACY.share("the frontier"))) for d in drops.values())


def test_the_verdicts_say_the_bytes_each_held_and_the_tally(results):
    text = "\n".join(frontier.lines(results))
    assert "adakv loses less than snapkv" in text and "duo loses more than snapkv" in text
    assert "pyramidkv and snapkv are not distinguishable on these 100 items" in text
    assert "holding 11.0% of the full cache's KV bytes per token against 11.0%" in text
    assert "holding 12.0% of the full cache's KV bytes per token against 11.0%." in text
    assert "of 3 hybrid-against-uniform comparisons, the hybrid" in text


def test_a_task_the_full_cache_fails_gives_no_verdict(results):
    failing = results.assign(correct=results["correct"].where(results["policy"] != "full", 0.0))
    assert frontier.comparisons(failing) == {}
    assert "no frontier verdict" in frontier.lines(failing)[0]


def test_the_points_are_every_policys_and_the_figure_draws_them(results):
    table = frontier.points(results)
    assert set(table["policy"]) == {"h2o", "snapkv", "streaming", "adakv", "duo", "pyramidkv", "quest"}
    row = table[table["policy"] == "h2o"].iloc[0]
    assert row["change_pp"] == pytest.approx(-30) and row["low_pp"] < -30 < row["high_pp"]
    assert dict(zip(table["policy"], table["kind"]))["duo"] == "hybrid"
    assert dict(zip(table["policy"], table["kind"]))["quest"] == "other"
    fig = frontier.plot(results)
    assert len(fig.axes[0].lines) > 0


def test_rows_without_the_bytes_held_give_no_frontier(results):
    assert frontier.points(results.drop(columns="kv_share_held")).empty


def test_ruler_is_a_unit_per_length_over_the_subtasks_the_full_cache_passes(results):
    ruler = results.assign(ruler_score=results["correct"], correct=math.nan, length=1024,
                           task=["niah_single_1" if i % 2 else "niah_single_2" for i in results["doc_id"]])
    drops = frontier.comparisons(ruler)
    assert {key[0] for key in drops} == {"RULER at 1,024 tokens"}
    assert drops[("RULER at 1,024 tokens", 0.1, "duo", "snapkv")].drop == pytest.approx(0.30)


def test_a_point_whose_forks_share_the_prompt_is_said_and_marked_on_a_multiple_choice_task_only(results):
    """quest's forked choices share the prompt's blocks: its bytes per token on a multiple-choice task count the
    prompt once, which no copying policy's do; RULER answers without forks, so there it is a point like any."""
    named = results.assign(runner=results["policy"])
    table = frontier.points(named).set_index("policy")
    assert table.loc["quest", "shared_prompt"] and not table.loc["h2o", "shared_prompt"]
    assert not frontier.points(results)["shared_prompt"].any()  # rows that do not name their runner: nothing said
    note = frontier.shared_prompt_note(named)
    assert len(note) == 1 and note[0].startswith("Mind: quest on kvlib_recall: the answer choices fork")
    ruler = named.assign(ruler_score=named["correct"], correct=math.nan, length=1024, task="niah_single_1")
    assert "quest" in set(frontier.points(ruler)["policy"]) and not frontier.points(ruler)["shared_prompt"].any()
