"""A profile's book lists its own executed chapters only: book/executed/ keeps each chapter as whichever profile's
build executed it last."""

import shutil

import nbformat
import yaml

from kvlib.paths import repo_root
from kvlib.study import book


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
