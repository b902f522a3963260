"""README's "Adding a policy", followed once: its code, written as a file of its own, registers a policy that the
command line lists, that passes the registry-wide tests, and that every `policies: all` experiment of a profile runs."""

import re
from pathlib import Path

import pytest
import test_booking
import test_engine
import test_serving_policies
import test_timing
from user_module import user_module

from kvlib import cli
from kvlib.policies import REGISTRY, available
from kvlib.study import load_profile

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture
def recent_window(tmp_path):
    """The README's policy, imported from a file as a module of the user's would be; unregistered afterwards."""
    section = README.read_text().split("## Adding a policy", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    with user_module(tmp_path / "recent_window.py", code, REGISTRY) as added:
        assert len(added) == 1, f"the README's code registered {sorted(added)}"
        yield added.pop()


def test_the_command_line_lists_it(recent_window, capsys):
    assert cli.main(["policies"]) == 0
    out = capsys.readouterr().out
    assert f"\n{recent_window}\n  budget = 0.3\n" in out  # its heading, then its settings with their defaults


def test_it_passes_the_registry_wide_tests(recent_window, tiny):
    test_booking.test_the_ledger_books_what_the_policy_holds(tiny, recent_window)
    test_booking.test_a_capacity_below_the_weights_is_a_recorded_oom(tiny, recent_window)
    test_timing.test_every_policy_reports_sections_that_add_up_to_its_run(tiny, recent_window)
    test_engine.test_every_policy_records_an_oom_instead_of_crashing(tiny, recent_window)
    test_serving_policies.test_continuous_with_every_request_at_the_start_gives_the_static_schedules_tokens(
        tiny, recent_window)
    test_serving_policies.test_a_capacity_too_small_for_every_request_gives_the_same_tokens(tiny, recent_window)


def test_every_experiment_that_runs_all_policies_runs_it(recent_window):
    profile = load_profile("smoke")
    runs_all = [e for e, spec in profile.experiments.items() if "all" in spec["policies"]]  # `all` or [all, ...]
    assert runs_all and recent_window in available()
    for experiment in runs_all:
        assert recent_window in {p.runner for p in profile.points(experiment)}, experiment
