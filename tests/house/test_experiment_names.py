"""An experiment's name is written once, in its module's declaration (kvlib.study.experiments.<name>); the rest of
kvlib reaches it through the registry (kvlib.study.experiment) or, where a page reads another chapter's rows, as an
attribute of kvlib.report.study_rows.StudyRows, so that adding or renaming an experiment is one file. The same word
in another sense (a metric, a timer's section, a page's error-rate family) is listed below with that sense and the
lines it takes, so that a new use of a name as a key fails here and is read by someone."""

import re

import pandas as pd
import pytest

from kvlib.paths import repo_root
from kvlib.report.study_rows import StudyRows
from kvlib.study.experiments import REGISTRY

OTHER_SENSES = {  # (file, word): (lines that quote the word, the sense they use it in)
    ("kvlib/engine/run_result.py", "offload"): (1, "a cache operation every run times (CACHE_OPS)"),
    ("kvlib/policies/kivi.py", "offload"): (3, "its timed section of that operation"),
    ("kvlib/policies/flexgen.py", "offload"): (2, "its timed section, and its disk tier's folder"),
    ("kvlib/policies/infinigen.py", "offload"): (1, "its timed section"),
    ("kvlib/policies/full.py", "serving"): (1, "a fidelity rule's aspect: how requests are batched"),
    ("kvlib/commands/choose.py", "serving"): (2, "an answer's kind, a key of `kvlib choose --json`"),
    ("kvlib/report/pages.py", "serving"): (1, "a page's error-rate family"),
    ("kvlib/report/pages.py", "accuracy"): (3, "a page's error-rate family and a question that spends its share"),
    ("kvlib/report/accuracy/lines.py", "accuracy"): (4, "the metric a table row holds"),
    ("kvlib/report/accuracy/tables.py", "accuracy"): (1, "the metric a table row holds"),
    ("kvlib/report/retention.py", "accuracy"): (1, "the metric a table row holds"),
    ("kvlib/report/choose/evidence.py", "accuracy"): (2, "the metric, and the chooser's question"),
    ("kvlib/report/choose/workload.py", "accuracy"): (1, "the chooser's question"),
    ("kvlib/report/accuracy/fig7.py", "accuracy"): (1, "an axis label"),
}
REGISTRY_MODULE = "kvlib/study/experiment.py"  # its docstring's example declaration


def quoted_lines() -> dict[tuple[str, str], int]:
    """(file, experiment name) -> the lines of a kvlib file that quote the name, outside the experiment's module."""
    found = {}
    for path in sorted((repo_root() / "kvlib").rglob("*.py")):
        rel = path.relative_to(repo_root()).as_posix()
        text = path.read_text()
        for name in REGISTRY:
            if rel in (f"kvlib/study/experiments/{name}.py", REGISTRY_MODULE):
                continue
            hits = sum(bool(re.search(rf"[\"']{name}[\"']", line)) for line in text.splitlines())
            if hits:
                found[(rel, name)] = hits
    return found


def test_an_experiments_name_is_quoted_only_in_its_module_or_in_another_sense():
    found = quoted_lines()
    assert found == {key: lines for key, (lines, _) in OTHER_SENSES.items()}, (
        "an experiment's name quoted outside its module: reach it through the registry or StudyRows, or list the "
        f"word's other sense here: {sorted(set(found.items()) - {(k, v[0]) for k, v in OTHER_SENSES.items()})}")


def test_the_rows_pages_read_across_chapters_are_registered_experiments():
    assert set(StudyRows.names()) <= set(REGISTRY)
    assert list(StudyRows.names()) == [n for n in REGISTRY if n in StudyRows.names()]  # in the book's order


def test_a_misspelt_experiment_fails_where_it_is_written():
    with pytest.raises(TypeError, match="batch_scalling"):
        StudyRows(batch_scalling=pd.DataFrame())
    with pytest.raises(AttributeError):
        StudyRows().batch_scalling  # noqa: B018


def test_rows_are_read_only_when_a_page_asks_for_them():
    asked = []
    rows = StudyRows(lambda name: asked.append(name) or pd.DataFrame({"n": [1]}))
    assert rows.ttft.n.tolist() == [1] and rows.ttft is rows.ttft
    assert asked == ["ttft"]
