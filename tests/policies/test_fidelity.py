"""The fidelity table (kvlib.policies.fidelity): every registered policy declares its official source and rules, each
rule states kvlib's value, a departure says why, and the methods page's table is the one the declarations give."""

import subprocess
import sys
from dataclasses import dataclass
from typing import ClassVar

import pytest

from kvlib.errors import UserError
from kvlib.policies import REGISTRY, fidelity
from kvlib.policies.fidelity import Fidelity, Rule, Source
from kvlib.study.results import repo_root


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_policy_states_its_rules(name):
    entry = REGISTRY[name].__dict__.get("fidelity")
    assert entry is not None, f"{name} declares no fidelity entry"
    assert entry.source.repo and len(entry.source.commit) >= 7 and entry.source.file
    assert entry.rules, name
    for rule in entry.rules:
        assert fidelity.verdict(REGISTRY[name], rule) in ("same", f"differs: {rule.differs}")


def test_the_methods_page_shows_the_declared_table():
    """book/fidelity.md is what the declarations give (the book's build writes it; this fails if it went stale)."""
    assert (repo_root() / "book" / "fidelity.md").read_text() == fidelity.markdown(REGISTRY)
    assert "{include} fidelity.md" in (repo_root() / "book" / "methods.md").read_text()


def test_the_command_line_prints_it():
    out = subprocess.run([sys.executable, "-m", "kvlib", "policies", "--fidelity"], capture_output=True, text=True,
                         check=True).stdout
    words = " ".join(out.split())  # each policy under its source, its rules wrapped to a terminal's width
    for r in fidelity.rows(REGISTRY):
        assert " ".join(f"{r['rule']}: official {r['official']}; kvlib {r['kvlib']}".split()) in words, r
    assert "\n  alpha: official 5.0; kvlib 5.0 (alpha): same\n" in out.split("\ninfinigen: ")[1]


@dataclass
class Toy:
    name: ClassVar[str] = "toy"
    window: int = 32


@pytest.mark.parametrize("rule, message", [
    (Rule("window", 8, setting="window"), "without saying why"),
    (Rule("window", 32, setting="window", differs="because"), "says it differs"),
    (Rule("window", 32, setting="kernel"), "which it lacks"),
    (Rule("pooling", "max"), "states no kvlib value"),
])
def test_a_declaration_that_contradicts_itself_is_refused(rule, message):
    Toy.fidelity = Fidelity(Source("o/r", "abcdef0", "f.py"), (rule,))
    with pytest.raises(UserError, match=message):
        fidelity.rows({"toy": Toy})


def test_a_setting_departure_reads_its_reason():
    Toy.fidelity = Fidelity(Source("o/r", "abcdef0", "f.py"), (Rule("window", 8, setting="window", differs="why"),))
    (row,) = fidelity.rows({"toy": Toy})
    assert (row["official"], row["kvlib"], row["verdict"]) == ("8", "32", "differs: why")
