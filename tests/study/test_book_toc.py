"""A profile's book lists its own executed chapters only: book/executed/ keeps each chapter as whichever profile's
build executed it last."""

import shutil

import nbformat
import yaml

from kvlib.paths import repo_root
from kvlib.study import book
from kvlib.study.profile import load_profile


def test_a_profiles_book_lists_its_chapters_and_not_another_profiles(tmp_path, monkeypatch):
    (tmp_path / "book" / "executed").mkdir(parents=True)
    shutil.copy(repo_root() / "book" / "_toc.yml", tmp_path / "book" / "_toc.yml")
    monkeypatch.setenv("KVLIB_ROOT", str(tmp_path))
    for chapter, profile in [("ttft", "embedded"), ("accuracy", "confirmatory"), ("findings", "confirmatory")]:
        nb = nbformat.v4.new_notebook(metadata={"papermill": {"parameters": {"profile": profile}}})
        nbformat.write(nb, tmp_path / "book" / "executed" / f"{chapter}.ipynb")
    listed = [c["file"] for c in yaml.safe_load(book.toc_for("confirmatory").read_text())["chapters"]]
    assert [f for f in listed if f.startswith("executed/")] == ["executed/findings", "executed/accuracy"]
    assert "methods" in listed  # the pages every profile's book holds
    everything = [c["file"] for c in yaml.safe_load((repo_root() / "book" / "_toc.yml").read_text())["chapters"]]
    assert [f for f in listed if not f.startswith("executed/")] == [f for f in everything
                                                                   if not f.startswith("executed/")]


def test_a_profile_without_timings_gets_no_chooser_and_a_run_of_one_experiment_refreshes_the_pages_reading_it():
    untimed = ["accuracy", "retention"]  # the confirmatory profile's
    assert book.chapters_for(untimed, untimed) == ["accuracy", "retention", "paper_scale", "findings"]
    embedded = load_profile("embedded", repo_root()).experiments
    assert book.chapters_for(["accuracy"], embedded) == ["accuracy", "paper_scale", "choose", "findings"]


def test_chapters_run_side_by_side_the_cross_experiment_ones_first_and_come_back_in_the_books_order(monkeypatch):
    import threading
    import time

    started, running, most = [], [], [0]
    lock = threading.Lock()

    def execute(chapter, profile):
        with lock:
            started.append(chapter)
            running.append(chapter)
            most[0] = max(most[0], len(running))
        time.sleep(0.05)
        with lock:
            running.remove(chapter)
        return chapter

    monkeypatch.setattr(book, "execute", execute)
    monkeypatch.setattr(book.os, "cpu_count", lambda: 2)
    chapters = ["ttft", "accuracy", "paper_scale", "choose", "findings"]
    assert book.execute_all(chapters, "embedded") == chapters
    assert set(started[:2]) == {"paper_scale", "choose"} and most[0] == 2
    assert book.execute_all([], "embedded") == []
