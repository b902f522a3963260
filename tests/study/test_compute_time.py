"""Where a build's time went: each unit counted once, whatever its number of rows."""

import pandas as pd

from kvlib.study.compute_time import minutes_by, unit_times


def test_a_unit_is_counted_once_and_minutes_add_up_by_runner():
    rows = pd.DataFrame({
        "experiment": ["accuracy"] * 3 + ["ttft"] * 2,
        "runner": ["full", "full", "h2o", "full", "full"],
        "point_hash": ["a", "a", "b", "c", "c"],
        "repeat": [0, 0, 0, 0, 1],
        "unit_compute_s": [120.0, 120.0, 60.0, 30.0, 30.0],  # accuracy's unit "a" has two item rows
    })
    assert len(unit_times(rows)) == 4
    by_experiment = minutes_by(rows, ["experiment"]).set_index("experiment")
    assert by_experiment.loc["accuracy", "minutes"] == 3.0 and by_experiment.loc["accuracy", "units"] == 2
    assert by_experiment.loc["ttft", "minutes"] == 1.0 and by_experiment.loc["ttft", "units"] == 2
    by_runner = minutes_by(rows[rows.experiment == "accuracy"], ["runner"])
    assert by_runner["runner"].tolist() == ["full", "h2o"]  # the costliest first


def test_rows_written_before_the_column_are_left_out():
    old = pd.DataFrame({"experiment": ["ttft"], "runner": ["full"], "point_hash": ["a"], "repeat": [0]})
    assert unit_times(old).empty and minutes_by(old, ["experiment"]).empty


def test_a_unit_computed_beside_others_counts_its_share_of_the_wall_time():
    rows = pd.DataFrame({"experiment": ["accuracy"] * 3, "runner": ["full", "h2o", "h2o"], "point_hash": ["a", "b", "c"],
                         "repeat": [0, 0, 0], "unit_compute_s": [120.0, 60.0, 60.0], "unit_workers": [2, 2, None]})
    assert unit_times(rows)["unit_compute_s"].tolist() == [60.0, 30.0, 60.0]  # serial units: their own time


def test_each_unit_is_stamped_when_it_finished_not_when_its_run_began(monkeypatch):
    """A reference book's "computed on" and its span read `finished_at`: stamped at the run's start, every unit of a
    two-day run said it finished the first day."""
    import time
    from datetime import datetime
    from types import SimpleNamespace

    from kvlib.study import executor

    began = {}

    def run_point(point, kept):
        time.sleep(0.01)
        began["unit"] = datetime.now().astimezone().isoformat()
        return [{"score": 1.0}]

    monkeypatch.setattr(executor, "declared", lambda name: SimpleNamespace(timed=False, run_point=run_point))
    meta = executor.run_metadata("p")
    row = executor._compute_unit(SimpleNamespace(experiment="stand_in", columns=lambda: {"runner": "full"}), 0, meta)
    assert pd.Timestamp(row["finished_at"].iloc[0]) >= pd.Timestamp(began["unit"])
