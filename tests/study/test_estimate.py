"""kvlib study's estimate of a build's time before it starts: the reference book's unit times, scaled by this machine's
probe against the reference machine's, a disturbed or unknown unit standing in at its runner's median."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kvlib.study import estimate, reference, run
from kvlib.study.executor import units_to_compute
from kvlib.study.point import Point

PUBLISHED = reference.README_PROFILE


def rows(*units):
    """Reference rows: (point_hash, repeat, runner, seconds, disturbed), two rows a unit (an accuracy unit has one a
    item: counted once)."""
    return pd.DataFrame([{"experiment": "ttft", "point_hash": p, "repeat": r, "runner": runner, "unit_compute_s": s,
                          "disturbed": d} for p, r, runner, s, d in units for _ in range(2)])


def point(key, runner="full"):
    p = Point("ttft", runner, {}, {}, "m")
    p.__dict__["key"] = key  # its cached key, as if the grid had named it so
    return p


def test_a_unit_takes_its_own_time_a_disturbed_one_its_runners_calm_median():
    table = rows(("a", 0, "full", 10.0, False), ("b", 0, "full", 20.0, False), ("c", 0, "full", 900.0, True),
                 ("d", 0, "h2o", 5.0, False))
    got = estimate.experiment_estimate("ttft", [(point("a"), 0), (point("c"), 0), (point("d", "h2o"), 0)], table)
    assert got.units == 3 and got.unknown == 0
    assert got.reference_s == pytest.approx(10 + 15 + 5)  # c: full's undisturbed median, not its 900 s


def test_a_unit_the_reference_lacks_stands_in_at_another_repeat_then_its_runner():
    table = rows(("a", 0, "full", 10.0, False), ("b", 0, "full", 30.0, False), ("d", 0, "h2o", 5.0, False))
    todo = [(point("a"), 1), (point("new"), 0), (point("x", "quest"), 0)]
    got = estimate.experiment_estimate("ttft", todo, table)
    # a's repeat 1: a's own 10 s; "new": full's median 20 s; quest: the experiment's median unit 10 s
    assert got.reference_s == pytest.approx(10 + 20 + 10)
    assert estimate.experiment_estimate("ttft", todo, pd.DataFrame()).unknown == 3


def test_the_range_scales_by_each_probe_rate():
    there = {"matmul_fp32_gflop_per_s": 400.0, "decode_linears_16_rows": {"gflop_per_s": 80.0}}
    here = {"matmul_fp32_gflop_per_s": 100.0, "decode_linears_16_rows": {"gflop_per_s": 40.0}}
    assert estimate.slowdowns(there, here) == {"decode-shaped linears": 2.0, "matmul": 4.0}
    assert estimate.slowdowns(there, {"matmul_fp32_gflop_per_s": None}) == {}


@pytest.mark.skipif(reference.about(PUBLISHED) is None, reason="no published reference")
def test_the_published_profiles_estimate_on_its_own_machine_is_its_time_and_fits_100_columns():
    profile = run.load_profile(PUBLISHED)
    todo = {e: units_to_compute(profile, e, force=True) for e in profile.experiments}
    there = json.loads((reference.folder(PUBLISHED) / "machine.json").read_text())
    said = estimate.announce(PUBLISHED, todo, lambda: there)
    total = sum(estimate.experiment_estimate(e, u, reference.load(PUBLISHED, e)).reference_s for e, u in todo.items())
    minutes = round(total / 60)
    assert f"estimated {minutes}-{minutes} min here" in said
    assert all(len(line) <= 100 for line in said.splitlines())
    assert len(said.splitlines()) > len(todo)  # a line per experiment
    slower = {**there, "matmul_fp32_gflop_per_s": there["matmul_fp32_gflop_per_s"] / 3}
    assert f"estimated {minutes}-{round(total / 60 * 3)} min here" in estimate.announce(PUBLISHED, todo,
                                                                                         lambda: slower)
    assert estimate.announce(PUBLISHED, {e: [] for e in todo}, lambda: there) is None  # nothing to compute


def test_study_says_its_estimate_before_it_computes(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(run.estimate, "announce", lambda profile, todo, probe: "ESTIMATE " + ",".join(todo))
    monkeypatch.setattr(run, "run_experiment", lambda prof, name, **kw: calls.append(capsys.readouterr().out))
    run.run_study("smoke", experiments=["ttft"], notebooks=False)
    assert calls and "ESTIMATE ttft" in calls[0]  # printed before the first experiment ran


def test_a_profile_without_a_reference_book_gets_no_estimate_and_no_probe():
    assert estimate.announce("smoke", {"ttft": [(point("a"), 0)]}, lambda: pytest.fail("probed")) is None


@pytest.mark.skipif(reference.about(PUBLISHED) is None, reason="no published reference")
def test_workers_weigh_a_unit_by_its_reference_time_where_there_is_one():
    assert estimate.unit_weight("smoke", "accuracy") is None  # no reference book: every unit alike
    weight = estimate.unit_weight(PUBLISHED, "accuracy")
    units = units_to_compute(run.load_profile(PUBLISHED), "accuracy", force=True)
    times = [weight(p, r) for p, r in units]
    assert all(t > 0 for t in times) and max(times) > 5 * min(times)  # units differ: a count would not balance them
