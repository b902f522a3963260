"""Finding 4 as the paper states it: its six tasks under protocol one_pass, H2O under FlexGen's rule, InfiniGen at
alpha 5, drops averaged over the tasks the full cache passes (each 1/k); the other readings beside it, never in it;
finding 5 reading H2O's flexgen rows."""

import math

import matplotlib
import numpy as np
import pandas as pd
import pytest
from paper_rows import NAN, POINTS, paper_frame  # tests/helpers

from kvlib.report import stats
from kvlib.report.accuracy.fig7 import fig7, fig7_points
from kvlib.report.accuracy.paper_beside import accuracy_claims
from kvlib.report.accuracy.paper_tasks import CLAIMS, PAPER_TASKS
from kvlib.report.pages import FINDINGS
from kvlib.report.retention import claims as retention_claims
from kvlib.report.stats import CONFIRMED, INCONCLUSIVE, REFUTED

matplotlib.use("Agg")


def book_frame(items=200, lost=1.0):
    """kvlib_recall rows: H2O at 0.5 loses `lost` of every item."""
    rows = [{"model": "m", "task": "kvlib_recall", "protocol": "strict", "policy": p, "budget": b, "doc_id": i,
             "correct": 0.0 if p == "h2o" and i < lost * items else 1.0}
            for p, b in (("full", NAN), ("h2o", 0.5), ("infinigen", 0.5), ("h2o", 0.1), ("infinigen", 0.1))
            for i in range(items)]
    return pd.DataFrame(rows)


def named(claims, start):
    found = [c for c in claims.claims if c.name.startswith(start)]
    assert len(found) == 1, [c.name for c in claims.claims]
    return found[0]


def test_the_declared_claims_are_eight_and_drive_the_level():
    assert dict(FINDINGS.weights)["finding 4"] == len(CLAIMS) == 8
    assert FINDINGS.level("finding 4") == 1 - stats.ALPHA / FINDINGS.total
    claims = accuracy_claims(paper_frame(), 0.7)
    assert len(claims.verdicts) == 8 and not claims.untested


def test_the_paper_shaped_truth_reads_confirmed_and_every_claim_can_fail():
    claims = accuracy_claims(paper_frame(), 0.7)
    assert set(claims.verdicts) == {CONFIRMED}, [c.line() for c in claims.claims]
    # InfiniGen losing 25 pp at 0.1, H2O nothing: the ~6 pp claim refuted, "H2O loses more" refuted
    worse = dict(POINTS) | {("infinigen", 0.1, NAN, 5.0): 0.25, ("h2o", 0.1, "flexgen", NAN): 0.0,
                            ("h2o", 0.5, "flexgen", NAN): 0.3, ("h2o", 0.04, "flexgen", NAN): 0.0,
                            ("infinigen", 0.3, NAN, 5.0): 0.3}
    claims = accuracy_claims(paper_frame(points=worse), 0.7)
    for start in ("infinigen at budget 0.1", "H2O loses more", "h2o at budget 0.5", "h2o at a 2-4 %",
                  "infinigen at budget 0.3"):
        assert named(claims, start).verdict == REFUTED, named(claims, start).line()


def test_a_task_at_chance_is_gated_out_and_named():
    claims = accuracy_claims(paper_frame(full_shares={"copa": 0.5}), 0.7)
    text = "; ".join(claims.context)
    assert "task copa is beyond the model" in text and "not above the 50% that guessing scores" in text
    assert "\ncopa:" not in text and not any(line.startswith("copa: full cache") for line in claims.context)
    assert any(line.startswith("piqa: full cache") for line in claims.context)
    assert "5 of 5 gated tasks" in named(claims, "h2o at budget 0.3").name


def test_the_task_average_weighs_tasks_equally():
    """One big task losing nothing does not drown five small ones losing 7.2 pp: the average is 6 pp, not ~1."""
    sizes = {"hellaswag": 2000}
    losses = dict(POINTS)
    frame = paper_frame(items=150, sizes=sizes, points=losses)
    at = (frame["policy"] == "infinigen") & (frame["budget"] == 0.1) & (frame["alpha"] == 5.0)
    big = at & (frame["task"] == "hellaswag")
    full = frame[(frame["policy"] == "full") & (frame["task"] == "hellaswag")]["correct"].to_numpy()
    frame.loc[big, "correct"] = full  # loses nothing
    small = at & (frame["task"] != "hellaswag")
    for task in set(PAPER_TASKS) - {"hellaswag"}:
        rows = small & (frame["task"] == task)
        ref = frame[(frame["policy"] == "full") & (frame["task"] == task)]["correct"].to_numpy().copy()
        ref[np.flatnonzero(ref)[:round(0.072 * 150)]] = 0.0
        frame.loc[rows, "correct"] = ref
    drop = named(accuracy_claims(frame, 0.7), "infinigen at budget 0.1").drop
    assert drop.drop == pytest.approx(5 * 0.072 / 6, abs=0.002)  # the pooled items would say ~0.9 pp
    assert drop.clusters == math.floor(stats.effective_items([150] * 5 + [2000]))


def test_a_known_6_pp_drop_reads_confirmed_with_enough_items_and_inconclusive_with_few():
    many = named(accuracy_claims(paper_frame(items=400), 0.7), "infinigen at budget 0.1")
    assert many.drop.drop == pytest.approx(0.06, abs=0.003) and many.verdict == CONFIRMED, many.line()
    few = named(accuracy_claims(paper_frame(items=25), 0.7), "infinigen at budget 0.1")
    assert few.verdict == INCONCLUSIVE, few.line()


def test_h2o_seen_rows_never_enter_the_verdict():
    base = accuracy_claims(paper_frame(), 0.7)
    harsher = dict(POINTS) | {("h2o", 0.5, "seen", NAN): 1.0, ("h2o", 0.1, "seen", NAN): 1.0}
    other = accuracy_claims(paper_frame(points=harsher), 0.7)
    assert [(c.name, c.drop.drop, c.verdict) for c in base.claims] == \
        [(c.name, c.drop.drop, c.verdict) for c in other.claims]
    assert any(line.startswith("beside, not in the verdict: H2O under the seen rule") and "budget 0.5" in line
               for line in other.context)
    only_seen = {k: v for k, v in POINTS.items() if not (k[0] == "h2o" and k[2] == "flexgen")}
    claims = accuracy_claims(paper_frame(points=only_seen), 0.7)
    assert not [c for c in claims.claims if c.name.startswith(("h2o", "H2O"))]
    assert any(u.startswith("h2o at budget 0.5 near") for u in claims.untested)


def test_equal_share_and_strict_lines_stand_beside():
    frame = pd.concat([paper_frame(), paper_frame(protocol="strict", points={("h2o", 0.5, "flexgen", NAN): 1.0})])
    claims = accuracy_claims(frame, 0.7)
    text = "; ".join(claims.context)
    assert ("(H2O flexgen at budget 0.1 attended 20.0% of the causal entries, task average, measured; InfiniGen's "
            "shares measured too): against InfiniGen at equal entries (alpha inf, budget 0.2: 20.0%), -10.0 pp") in text
    assert "protocol strict) of the same tasks, h2o at budget 0.5, task average: -80.0 pp" in text
    assert named(claims, "h2o at budget 0.5").verdict == CONFIRMED  # strict's -80 pp is beside, not in it
    assert "smollm2-135m" in text and "16-60x smaller" in text and "4-bit GGUF" in text


def test_without_an_equal_share_infinigen_brackets_h2os():
    """H2O at 0.1 attends 25 %: no InfiniGen point within 5 % of it, so the two around it, each at its measured
    share."""
    claims = accuracy_claims(paper_frame(shares={("h2o", 0.1, "flexgen", NAN): 0.25}), 0.7)
    line = next(c for c in claims.context if "H2O flexgen at budget 0.1 attended 25.0%" in c)
    assert "equal entries" not in line
    # InfiniGen at alpha inf, 0.2 (20 %) lost 5 % of the items, H2O 15 %; InfiniGen at alpha 5, 0.3 (30 %) 1 %
    assert "against InfiniGen on no more entries (alpha inf, budget 0.2: 20.0%), -10.0 pp" in line
    assert "against InfiniGen on more entries (alpha 5, budget 0.3: 30.0%), -14.0 pp" in line


def test_every_claim_names_the_share_its_policy_attended():
    """InfiniGen's official rule caps no row where int(budget x tokens) is 0: a short task's items attend every entry
    at 0.04, and the claim read there says so."""
    shares = {("infinigen", 0.04, NAN, 5.0): 1.0}
    frame = paper_frame(tasks=("piqa", "copa"), shares=shares)
    frame.loc[(frame["policy"] == "infinigen") & (frame["budget"] == 0.04) & (frame["task"] == "piqa"),
              "kv_share_attended"] = 0.1
    claims = accuracy_claims(frame, 0.7)
    assert "attended 55% of the causal entries, 10% to 100% by task" in named(claims, "infinigen at a 2-4 %").name
    assert "attended 10% of the causal entries)" in named(claims, "infinigen at budget 0.1").name
    assert "H2O attended 20% of the causal entries, InfiniGen attended 10%" in named(claims, "H2O loses more").name


def test_book_task_rows_never_enter_finding_4s_verdict():
    base = accuracy_claims(paper_frame(), 0.7)
    mixed = accuracy_claims(pd.concat([paper_frame(), book_frame()], ignore_index=True), 0.7)
    assert [(c.name, c.drop.drop, c.verdict) for c in base.claims] == \
        [(c.name, c.drop.drop, c.verdict) for c in mixed.claims]
    assert any(line.startswith("the book's extension (kvlib_recall") for line in mixed.context)
    alone = accuracy_claims(book_frame(), 0.7)
    assert not alone.claims and len(alone.untested) == 8 and set(alone.verdicts) == {"untested"}
    assert any(line.startswith("the book's extension") for line in alone.context)


def test_the_task_average_interval_resamples_within_tasks():
    values = np.r_[np.ones(10), np.zeros(1000)]
    tasks = ["a"] * 10 + ["b"] * 1000
    d = stats.task_average(values, tasks, level=0.95)
    assert d.drop == pytest.approx(0.5) and d.clusters == math.floor(stats.effective_items([10, 1000]))
    assert d.low <= 0.5 <= d.high and d.verdict == stats.LOWER


def retention_frame(flexgen_keeps=0.6, seen_keeps=0.0, conversations=200, seed=1, rule=True):
    rng = np.random.default_rng(seed)
    rows = []
    for c in range(conversations):
        bucket = "2K-4K" if c % 2 else "1K-2K"
        answers = {("full", NAN): True, ("infinigen", NAN): True, ("h2o", "flexgen"): rng.random() < flexgen_keeps,
                   ("h2o", "seen"): rng.random() < seen_keeps}
        for turn in (2, 4):
            for (policy, r), correct in answers.items():
                row = {"model": "m", "policy": policy, "budget": NAN if policy == "full" else 0.3, "bucket": bucket,
                       "conversation": f"c{c}", "turn": turn, "correct": correct, "protocol": "deployed"}
                if rule:
                    row["budget_rule"] = r
                elif r == "seen":
                    continue
                rows.append(row)
    return pd.DataFrame(rows)


def test_finding_5_reads_h2os_flexgen_rows_and_shows_seen_beside():
    claims = retention_claims(retention_frame(), 0.7)
    h2o = named(claims, "h2o 17-27 pp lower")
    assert h2o.drop.drop == pytest.approx(0.4, abs=0.08), h2o.line()  # flexgen keeps 60 %, seen none
    assert any(line.startswith("beside, not in the verdict: H2O under the seen rule") and "-100.0 pp" in line
               for line in claims.context)
    old = retention_claims(retention_frame(rule=False), 0.7)  # rows from before budget_rule: as today
    assert named(old, "h2o 17-27 pp lower").drop.drop == pytest.approx(h2o.drop.drop)
    assert not any("seen rule" in line for line in old.context)


def test_fig7_has_six_panels_from_the_rows():
    frame = paper_frame(items=40, tasks=("piqa", "copa"))
    points = fig7_points(frame)
    assert set(points["line"]) >= {"full", "h2o (flexgen)", "h2o (seen)", "infinigen", "infinigen (alpha inf)"}
    fig = fig7(frame)
    assert len(fig.axes) == 6 and "SmolLM2-135M-Instruct" in fig._suptitle.get_text()  # as README names it
    assert [ax.get_title() for ax in fig.axes] == ["PIQA", "COPA", "WinoGrande", "HellaSwag", "OpenBookQA", "BoolQ"]
