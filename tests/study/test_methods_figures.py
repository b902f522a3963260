"""The methods page's figures that the code holds (rounds, levels, the validity gate, sizes) are generated
(kvlib.study.methods_figures): the page holds what the code gives, its figures are the profiles' and the
declarations', and none of them is typed by hand elsewhere on the page (it once said 8 rounds where the profile ran
10)."""

import re

import pytest

from kvlib.paths import repo_root
from kvlib.report.gate import GATE
from kvlib.report.pages import FINDINGS
from kvlib.study import load_profile, methods_figures

PAGE = repo_root() / methods_figures.PAGE
REGENERATE = ".venv/bin/python -c 'from kvlib.study import methods_figures; methods_figures.write()'"


@pytest.mark.parametrize("name", sorted(methods_figures.SECTIONS))
def test_the_pages_generated_sections_are_what_the_code_gives(name):
    held = methods_figures.current(PAGE.read_text(), name)
    assert held is not None, f"book/methods.md lacks its {name} section's markers"
    assert held == methods_figures.section(name), f"book/methods.md's {name} section is stale: {REGENERATE}"


def row(section: str, *cells: str) -> str:
    return next(line for line in methods_figures.SECTIONS[section]().splitlines()
                if all(f"| {cell} |" in line for cell in cells))


def test_the_figures_are_the_codes():
    embedded = load_profile("embedded")
    rounds = embedded.repeats("batch_scaling")
    assert f"| {rounds} | {2 / 2**rounds:.4f} |" in row("rounds", "`embedded`", "batch_scaling")
    for name in ("paper", "paper-shapes"):
        assert "| yes |" in row("rounds", f"`{name}`", "batch_scaling")
    assert f"on {GATE:.0%} of a task's items" in methods_figures.families()
    share = FINDINGS.share("finding 2")
    assert f"{share:.2%}" in row("families", "findings", "finding 2")
    recall = embedded.experiments["accuracy"]["fixed"]["offline_tasks"]["recall_items"]
    assert f"kvlib_recall: {recall} items" in row("sizes", "`embedded`", "accuracy")
    retention = embedded.experiments["retention"]["fixed"]
    conversations = len(retention["buckets"]) * retention["per_bucket"]
    assert f"{conversations} conversations a policy" in row("sizes", "`embedded`", "retention")


def test_no_figure_the_code_holds_is_typed_elsewhere_on_the_page():
    text = PAGE.read_text()
    for name in methods_figures.SECTIONS:
        text = text.replace(methods_figures.current(text, name), "")
    typed = re.findall(r"\b\d+ rounds\b|\d+ % by default|\bsix claims\b|5 % / 13|\b\d+ conversations\b|"
                       r"\b\d+ (?:paired )?(?:recall|RULER) items\b", text)
    assert not typed, f"typed by hand in book/methods.md (generate them: kvlib.study.methods_figures): {typed}"


def test_the_claims_the_page_counts_in_words_are_the_declared_ones():
    words = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8}
    said = re.findall(r"Finding (\d) is (\w+) claims", PAGE.read_text())
    assert said, "the page no longer counts findings' claims in words: drop this test"
    for finding, count in said:
        assert words[count] == dict(FINDINGS.weights)[f"finding {finding}"], (finding, count)
