"""The validity gate (kvlib.report.gate): comparisons only where the full cache passes; on synthetic frames."""

import pandas as pd

from kvlib.report import gate
from kvlib.report import retention as retention_page
from kvlib.report.accuracy import lines as accuracy_page


def recall_rows(task, full_right, items=50, model="m"):
    """full right on the first `full_right` items; h2o at 0.1 loses every other one of them."""
    rows = [{"model": model, "task": task, "policy": "full", "budget": None, "doc_id": i, "correct": float(i < full_right)}
            for i in range(items)]
    rows += [{"model": model, "task": task, "policy": "h2o", "budget": 0.1, "doc_id": i,
              "correct": float(i < full_right and i % 2 == 0)} for i in range(items)]
    return rows


def test_the_gate_passes_a_task_the_full_cache_gets_right_and_fails_one_it_does_not():
    df = pd.DataFrame(recall_rows("easy", 45) + recall_rows("hard", 20))
    g = gate.accuracy_gate(df).set_index("task")
    assert g.loc["easy", "full_score"] == 0.9 and bool(g.loc["easy", "passes"])
    assert g.loc["hard", "full_score"] == 0.4 and not bool(g.loc["hard", "passes"])
    assert gate.passing(gate.accuracy_gate(df), "task") == {"easy"}
    assert gate.passing(gate.accuracy_gate(df, 0.3), "task") == {"easy", "hard"}  # the threshold is a setting


def test_findings_draw_no_verdict_on_a_task_beyond_the_model():
    lines = accuracy_page.lines(pd.DataFrame(recall_rows("easy", 45) + recall_rows("hard", 20)))
    assert any(line.startswith("Ours: easy at budget 0.1: h2o") and ": lower" in line for line in lines)
    assert any("task hard is beyond the model with m: the full cache scores 40% on 50 items, below the validity "
               "gate of 70%" in line for line in lines)
    assert not any(line.startswith("Ours: hard at budget") for line in lines)


def test_a_model_that_fails_one_ruler_length_is_gated_there_alone():
    rows = []
    for length, full_right in ((512, 9), (1024, 3)):
        for i in range(10):
            for policy, budget, score in (("full", None, float(i < full_right)), ("h2o", 0.1, 0.0)):
                rows.append({"model": "m", "task": "niah_single_1", "length": length, "policy": policy,
                             "budget": budget, "doc_id": i, "ruler_score": score, "correct": None})
    lines = accuracy_page.ruler(pd.DataFrame(rows))
    assert any("RULER subtask niah_single_1 at 1,024 tokens is beyond the model" in line for line in lines)
    assert any(line.startswith("Ours: RULER at 512 tokens, budget 0.1") for line in lines)
    assert not any(line.startswith("Ours: RULER at 1,024 tokens") for line in lines)


def retention_rows(full_right_by_bucket, protocol="deployed"):
    rows = []
    for bucket, right in full_right_by_bucket.items():
        for conv in range(10):
            for turn in (2, 4):
                for policy, correct in (("full", conv < right), ("h2o", conv < right // 2)):
                    rows.append({"model": "m", "policy": policy, "budget": None if policy == "full" else 0.3,
                                 "bucket": bucket, "conversation": f"{bucket}-{conv}", "turn": turn,
                                 "correct": correct, "protocol": protocol})
    return rows


def test_retention_compares_policies_over_the_passing_buckets_only():
    df = pd.DataFrame(retention_rows({"1K-2K": 9, "2K-4K": 2}))
    assert gate.passing(gate.retention_gate(df), "bucket") == {"1K-2K"}
    lines = retention_page.lines(df)
    assert any("retention bucket 2K-4K is beyond the model" in line for line in lines)
    assert any("20 questions per policy" in line for line in lines)  # one bucket's 10 conversations x 2 turns
    assert not any(line.startswith("Ours: bucket 2K-4K") for line in lines)
    none = retention_page.lines(pd.DataFrame(retention_rows({"2K-4K": 2})))
    assert any("no bucket passes the validity gate" in line for line in none)


def test_two_protocols_are_read_apart_never_pooled():
    df = pd.DataFrame(retention_rows({"1K-2K": 9}) + retention_rows({"1K-2K": 9}, "strict"))
    lines = retention_page.lines(df)
    assert any(line.startswith("Ours (deployed protocol): 20 questions per policy") for line in lines)
    assert any(line.startswith("Ours (strict protocol): 20 questions per policy") for line in lines)


def test_exploratory_policies_are_labelled_so():
    df = pd.DataFrame(recall_rows("easy", 45)).assign(role="confirmatory")
    streaming = df[df["policy"] == "h2o"].assign(policy="streaming", role="exploratory")
    lines = accuracy_page.lines(pd.concat([df, streaming]))
    assert any("streaming (exploratory)" in line for line in lines)
    assert not any("h2o (exploratory)" in line for line in lines)


def test_a_paper_task_passes_where_the_full_cache_is_above_chance_not_at_the_fixed_gate():
    """HellaSwag at 40 % over 200 items is far above its 25 % chance (Wilson's lower end 33 %): it passes where the
    fixed 70 % would fail it; PIQA at 55 % over 40 items is not shown above its 50 % (lower end 40 %): it fails."""
    rows = [{**r, "chance": 0.25} for r in recall_rows("hellaswag", 80, items=200)]
    rows += [{**r, "chance": 0.5} for r in recall_rows("piqa", 22, items=40)]
    g = gate.accuracy_gate(pd.DataFrame(rows)).set_index("task")
    assert g.loc["hellaswag", "full_score"] == 0.4 and bool(g.loc["hellaswag", "passes"])
    assert g.loc["piqa", "full_score"] == 0.55 and not bool(g.loc["piqa", "passes"])
    lines = gate.beyond_model(gate.accuracy_gate(pd.DataFrame(rows)))
    assert lines == [("Ours: task piqa is beyond the model with m: the full cache scores 55% on 40 items, not above "
                      "the 50% that guessing scores (the lower end of its 95 % Wilson interval); no verdict is drawn on "
                      "the policies there.")]
