"""The reference book published with the repository: its rows come back exactly as the book reads them, its verdicts
are what the current code draws from them, README shows them, and a rebuild says which it reproduces."""

import json

import numpy as np
import pandas as pd
import pytest

import kvlib.paths
from kvlib.report.study_rows import StudyRows
from kvlib.study import load_profile, readme, reference
from kvlib.study.experiments import names

PUBLISHED = reference.README_PROFILE


def test_rows_come_back_exactly_whatever_their_types(tmp_path, monkeypatch):
    nested = np.empty(2, dtype=object)
    nested[:] = [np.array([1, 2]), np.array([3])]
    frame = pd.DataFrame({
        "target": [3, "Paris", 4],                                  # a task's int and str targets
        "skew": [True, np.nan, False],                              # a setting missing from one policy's rows
        "per_layer": [np.array([0.5, 0.25]), np.nan, np.array([1.0])],
        "tokens": [nested, nested, nested],
        "empty": pd.Series([np.nan, np.nan, np.nan], dtype=object),
        "note": ["a", None, "c"],
        "tok_s": [1.5, 2.5, np.nan],
    })
    (tmp_path / "results").mkdir()
    reference._write_rows(frame, tmp_path / "results" / "x.parquet")
    monkeypatch.setattr(reference, "folder", lambda profile: tmp_path)
    pd.testing.assert_frame_equal(reference.load("any", "x"), frame)


@pytest.fixture(scope="module")
def published():
    info = reference.about(PUBLISHED)
    assert info is not None, f"reference/{PUBLISHED}/ is not published: `kvlib study --profile {PUBLISHED} --build --publish`"
    return info


@pytest.mark.parametrize("book", reference.published())
def test_the_published_verdicts_are_what_the_code_draws_from_the_published_rows(published, book):
    from kvlib.report.findings.verdicts import verdict_table

    rows = StudyRows(lambda experiment: reference.load(book, experiment))
    table = verdict_table(rows, load_profile(book).validity_gate)
    assert table[reference.VERDICT_FIELDS].to_dict(orient="records") == reference.about(book)["verdicts"]


def test_a_book_of_untimed_experiments_names_its_machine_from_its_rows():
    """No timed experiment, no measured limits (machine.json): the machine is what the rows say, its threads those
    its units used together (two one-thread workers: 2), never "a None-thread None"."""
    rows = pd.DataFrame({"machine_cpu": ["Xeon", "Xeon"], "machine_host": ["vm", "vm"], "cpu_threads": [1, 2],
                         "unit_workers": [2, None], "device_name": ["cpu", "cpu"], "torch_version": ["2.13", "2.13"]})
    assert reference._machine({}, rows) == {"cpu": "Xeon", "host": "vm", "threads": 2, "device": "cpu",
                                            "torch": "2.13"}
    measured = {"machine_cpu": "EPYC", "machine_host": "box", "threads": 16, "torch_version": "2.13"}
    assert reference._machine(measured, rows)["threads"] == 16


def test_readme_shows_the_published_verdicts(published):
    text = (kvlib.paths.repo_root() / "README.md").read_text()
    for section in readme.SECTIONS:
        assert readme.section_text(section) in text, \
            f"README's {section} section is stale: `kvlib study --build --publish` writes it"
    for finding in range(1, 6):  # each from the published book that reads it with the most units
        _, record = reference.strongest(finding)
        assert f"| **{record['verdict']}** |" in text


def test_the_published_pages_and_limits_are_there(published):
    folder = reference.folder(PUBLISHED)
    from kvlib.study.book import CHAPTERS

    assert sorted(p.stem for p in (folder / "chapters").glob("*.ipynb")) == sorted(CHAPTERS)
    assert json.loads((folder / "machine.json").read_text())["threads"] >= 1
    for chapter in (folder / "chapters").glob("*.ipynb"):  # executed: every code cell ran
        cells = [c for c in json.loads(chapter.read_text())["cells"] if c["cell_type"] == "code"]
        assert all(c["execution_count"] for c in cells), chapter.name


def test_a_profile_never_run_here_reads_its_reference_and_one_run_here_does_not(tmp_path, monkeypatch):
    root = tmp_path
    (root / "reference" / "p").mkdir(parents=True)
    (root / "reference" / "p" / "reference.json").write_text("{}")
    monkeypatch.setattr(kvlib.paths, "repo_root", lambda: root)
    assert kvlib.paths.read_from("p") == root / "reference" / "p"
    (root / "results" / "p").mkdir(parents=True)
    (root / "results" / "p" / "machine.json").write_text("{}")  # limits alone: nothing run yet
    assert kvlib.paths.read_from("p") == root / "reference" / "p"
    (root / "results" / "p" / "ttft").mkdir()
    (root / "results" / "p" / "ttft" / kvlib.paths.MANIFEST).write_text("{}")
    assert kvlib.paths.read_from("p") == root / "results" / "p"  # never a mix of this machine's rows and the reference's
    assert kvlib.paths.read_from("unpublished") == root / "results" / "unpublished"


def test_a_rebuild_says_which_verdicts_agree(published, monkeypatch):
    monkeypatch.setattr(reference, "stands_in", lambda profile: False)
    monkeypatch.setattr(reference, "is_own_build", lambda profile, info: False)
    ours = pd.DataFrame(published["verdicts"])
    flipped = {"confirmed": "refuted", "refuted": "confirmed"}
    first = ours.verdict[0].split(":")[0]
    ours.loc[0, "verdict"] = flipped.get(first, "confirmed")
    text = reference.reproduction_markdown(PUBLISHED, ours)
    lines = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(lines) == len(ours)
    books = reference.published()
    at = 4 + 2 * books.index(PUBLISHED)  # | # | this build | then each published book's verdict and agreement
    agreement = [[cell.strip() for cell in line.split("|")][at] for line in lines]
    assert agreement == ["**differs**"] + ["agrees"] * (len(ours) - 1)
    assert reference.reproduction_markdown("smoke", ours) == ""  # no reference book for smoke


def test_the_build_that_publishes_a_book_is_its_reference_not_a_reproduction_of_the_last(published, tmp_path,
                                                                                          monkeypatch):
    """Its findings page is executed from the rows it publishes: it says it is the reference book, where comparing
    with the book published before it would read its own changes as failures to reproduce."""
    monkeypatch.setattr(reference, "stands_in", lambda profile: False)
    monkeypatch.setattr(reference.results, "results_dir", lambda profile, e: tmp_path / e)
    ours = pd.DataFrame(published["verdicts"])
    start, end = published["computed_between"]
    (tmp_path / "ttft").mkdir()
    pd.DataFrame({"finished_at": [start, end]}).to_parquet(tmp_path / "ttft" / "a-r0.parquet")
    assert reference.reproduction_markdown(PUBLISHED, ours).startswith("*This page is the reference book (")
    pd.DataFrame({"finished_at": [start, "2099-01-01T00:00:00+00:00"]}).to_parquet(tmp_path / "ttft" / "a-r0.parquet")
    assert reference.reproduction_markdown(PUBLISHED, ours).startswith("**Reproduction.**")


def test_the_published_book_stands_in_only_where_nothing_was_run(published):
    note = reference.reproduction_markdown(PUBLISHED, pd.DataFrame(published["verdicts"]))
    results_here = any((kvlib.paths.repo_root() / "results" / PUBLISHED).glob(f"*/{kvlib.paths.MANIFEST}"))
    assert note.startswith(("**Reproduction.**", "*This page is the reference book")) == results_here
    assert ("reads the reference book's results" in note) == (not results_here)


def test_a_run_from_the_reference_starts_from_its_units_and_never_mixes_them_with_rows_here(tmp_path, monkeypatch):
    from kvlib.errors import UserError

    for module in (kvlib.paths, reference, reference.results):
        monkeypatch.setattr(module, "repo_root", lambda: tmp_path)
    with pytest.raises(UserError, match="not published"):
        reference.unpack("p")
    rows = pd.DataFrame({"point_hash": ["a", "a", "b"], "repeat": [0, 1, 0], "ttft_s": [1.0, 2.0, 3.0],
                         "tokens": [np.array([1, 2]), np.array([3]), np.array([4, 5])]})
    (tmp_path / "reference" / "p" / "results").mkdir(parents=True)
    (tmp_path / "reference" / "p" / "reference.json").write_text("{}")
    (tmp_path / "reference" / "p" / "machine.json").write_text('{"threads": 2}')
    reference._write_rows(rows, tmp_path / "reference" / "p" / "results" / "ttft.parquet")
    assert reference.unpack("p") == 3
    unit = pd.read_parquet(tmp_path / "results" / "p" / "ttft" / "a-r1.parquet")
    assert unit["ttft_s"].tolist() == [2.0] and unit["tokens"][0].tolist() == [3]
    assert sorted(p.name for p in (tmp_path / "results" / "p" / "ttft").glob("*.parquet")) == [
        "a-r0.parquet", "a-r1.parquet", "b-r0.parquet"]
    assert json.loads(kvlib.paths.machine_limits("p").read_text()) == {"threads": 2}  # the machine that timed them
    with pytest.raises(UserError, match="holds rows already"):
        reference.unpack("p")


def test_publishing_needs_the_chapters_the_run_executes():
    from kvlib.errors import UserError
    from kvlib.study import run_study

    for partial in ({"notebooks": False}, {"experiments": ["ttft"]}, {"policies": ["h2o"]}):
        with pytest.raises(UserError, match="--publish publishes the whole profile"):
            run_study("smoke", publish=True, **partial)


def test_a_published_book_holds_the_chapters_its_run_executed_and_no_other_profiles(tmp_path, monkeypatch):
    """book/executed/ keeps the chapters of whichever profile executed them last: publishing a profile without a
    TTFT experiment must not carry the embedded build's TTFT page into its book."""
    import yaml

    from kvlib.study import book, run

    monkeypatch.setenv("KVLIB_ROOT", str(tmp_path))
    (tmp_path / "params").mkdir()
    (tmp_path / "params" / "p.yaml").write_text(yaml.safe_dump({"model": "smollm2-135m", "experiments": {
        "accuracy": {"policies": ["full"], "grid": {"task": ["copa"]}}}}))
    executed = tmp_path / "book" / "executed"
    executed.mkdir(parents=True)
    (executed / "ttft.ipynb").write_text("another profile's page")

    def execute(chapter, profile):
        (executed / f"{chapter}.ipynb").write_text(profile)
        return executed / f"{chapter}.ipynb"

    monkeypatch.setattr(run, "run_experiment", lambda *a, **k: None)
    monkeypatch.setattr(run.estimate, "announce", lambda *a: None)
    monkeypatch.setattr(book, "execute", execute)
    monkeypatch.setattr(book, "write_overview", lambda *a: None)
    monkeypatch.setattr(reference, "save", lambda profile, gate: (reference.folder(profile) / "chapters").mkdir(
        parents=True))
    monkeypatch.setattr(readme, "write", lambda: None)
    run.run_study("p", publish=True)
    published = sorted(p.stem for p in (reference.folder("p") / "chapters").glob("*.ipynb"))
    # no chooser: it answers from timings, which an accuracy-only profile lacks (its page was tables of dashes)
    assert published == ["accuracy", "findings", "paper_scale"]
    assert all((reference.folder("p") / "chapters" / f"{c}.ipynb").read_text() == "p" for c in published)


def test_readme_names_each_model_its_verdicts_were_measured_on_and_what_device_means(published):
    from kvlib.models.embedded import EMBEDDED_MODELS

    section = readme.section_text("verdicts")
    models = {m for name in names() for m in reference.load(PUBLISHED, name).get("model", [])}
    assert models and all(EMBEDDED_MODELS[m].described in section for m in models)
    assert "run in fp32" in section and "configured" in section


def test_the_published_chapters_name_no_build_machines_folder(published):
    import re

    for chapter in (reference.folder(PUBLISHED) / "chapters").glob("*.ipynb"):
        found = re.findall(r"(?<![\w.])/(?:root|home|work|tmp|usr|opt|Users)/[^\s\"']*", chapter.read_text())
        assert not found, (chapter.name, found[:3])


@pytest.fixture
def two_books(published, tmp_path, monkeypatch):
    """The published book and a second one that ran only the accuracy and retention experiments, with more units:
    finding 4's claims on 1,800 items (against the first book's 25), finding 5's on as many conversations as the
    first book's."""
    from kvlib.report.findings.verdicts import NOT_RUN

    (tmp_path / "reference").mkdir()
    (tmp_path / "reference" / PUBLISHED).symlink_to(reference.folder(PUBLISHED))
    second = {**published, "profile": "confirmatory", "verdicts": [
        {"finding": n, "verdict": NOT_RUN, "numbers": "", "model": None, "sample_n": None, "sample_of": None}
        for n in (1, 2, 3)] + [
        {**published["verdicts"][3], "verdict": "confirmed: all 8 claims confirmed", "sample_n": 1800,
         "sample_of": "items"},
        {**published["verdicts"][4], "verdict": "refuted: H2O loses more (1 of 3 claims refuted, 2 inconclusive)"}]}
    (tmp_path / "reference" / "confirmatory").mkdir()
    (tmp_path / "reference" / "confirmatory" / "reference.json").write_text(json.dumps(second))
    monkeypatch.setattr(reference, "repo_root", lambda: tmp_path)
    return second


def test_each_finding_is_read_from_the_book_with_the_most_units_readmes_on_a_tie(published, two_books):
    assert reference.published() == [PUBLISHED, "confirmatory"]
    chosen = {n: reference.strongest(n)[0] for n in range(1, 6)}
    assert chosen == {1: PUBLISHED, 2: PUBLISHED, 3: PUBLISHED, 4: "confirmatory", 5: PUBLISHED}
    section = readme.verdicts_section()
    rows = [line for line in section.splitlines() if line.startswith("| 4 |")]
    assert "| **confirmed: all 8 claims confirmed** |" in rows[0]
    assert "[confirmatory](reference/confirmatory/chapters/findings.ipynb) | 1,800 items |" in rows[0]
    assert "this table reads 2 books, so the chance that any of its tested verdicts is wrong is at most 10%" in section
    assert "reference/confirmatory/chapters/findings.ipynb" in section.split("\n")[0]


def test_a_findings_page_says_which_verdicts_agree_with_every_published_book(published, two_books, monkeypatch):
    monkeypatch.setattr(reference, "stands_in", lambda profile: False)
    monkeypatch.setattr(reference, "is_own_build", lambda profile, info: False)
    ours = pd.DataFrame(published["verdicts"])
    text = reference.reproduction_markdown(PUBLISHED, ours)
    against = "this build against it"  # each agreement column is headed, not blank
    assert f"the {PUBLISHED} reference book | {against} | the confirmatory reference book | {against} |" in text
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()}
    assert rows["| 1"].endswith("| agrees | not run there | - |")
    word = published["verdicts"][3]["verdict"].split(":")[0]
    assert rows["| 4"].endswith(f"| agrees | confirmed | {'agrees' if word == 'confirmed' else '**differs**'} |")
    # the book's own build compares with the other book alone, and the other book's page with this one
    monkeypatch.setattr(reference, "is_own_build", lambda profile, info: True)
    text = reference.reproduction_markdown(PUBLISHED, ours)
    assert text.startswith("*This page is the reference book (") and "Against the other published" in text
    assert f"the {PUBLISHED} reference book" not in text and "the confirmatory reference book" in text
    theirs = pd.DataFrame(two_books["verdicts"])
    assert f"the {PUBLISHED} reference book" in reference.reproduction_markdown("confirmatory", theirs)


def test_a_reading_this_profiles_rows_cannot_give_reads_another_books_and_names_it(two_books, tmp_path):
    reads = lambda rows: "model" in rows and rows["model"].nunique() >= 2
    theirs = pd.DataFrame({"model": ["smollm2-135m", "qwen2.5-coder-1.5b"], "correct": [1.0, 0.0]})
    (tmp_path / "reference" / "confirmatory" / "results").mkdir()
    reference._write_rows(theirs, tmp_path / "reference" / "confirmatory" / "results" / "accuracy.parquet")
    ours = pd.DataFrame({"model": ["smollm2-135m"] * 2, "correct": [1.0, 1.0]})
    borrowed = reference.rows_for(PUBLISHED, "accuracy", ours, 0.5, reads)
    pd.testing.assert_frame_equal(borrowed.rows, theirs)
    assert borrowed.gate == load_profile("confirmatory").validity_gate
    assert borrowed.note.startswith("This section reads the confirmatory reference book's rows (confirmatory profile")
    both = pd.concat([ours, theirs])
    own = reference.rows_for(PUBLISHED, "accuracy", both, 0.5, reads)
    assert own.rows is both and own.gate == 0.5 and own.note is None
    alone = reference.rows_for("confirmatory", "accuracy", ours, 0.5, reads)  # no other book can give it either
    assert alone.rows is ours and alone.note is None
