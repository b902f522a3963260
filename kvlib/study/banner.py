"""What a chapter holds, said before anything else on it: the notebooks in notebooks/ are stored with the CI smoke run's
outputs (what `make test` compares under nbval), and a reader who opens one where the repository is browsed must not
take smoke's verdicts for the study's. A profile with a published reference book shows no banner: its pages are the
study's results (or a rebuild of them, which the findings page compares with the reference)."""

from __future__ import annotations

import warnings

from kvlib.study import reference

CI_PROFILE = "smoke"  # the profile of the notebooks' stored outputs (their parameters cell), run by `make test`


def reference_chapter(chapter: str) -> str:
    """The reference book's executed chapter, as a link from notebooks/ (where the stored notebooks are browsed)."""
    return f"../reference/{reference.README_PROFILE}/chapters/{chapter}.ipynb"


def text(profile: str, chapter: str) -> str:
    """The chapter's banner in Markdown; empty where the profile's results are a published reference book's."""
    if reference.about(profile) is not None:
        return ""
    study = reference.README_PROFILE
    there = f"this chapter there is [reference/{study}/chapters/{chapter}.ipynb]({reference_chapter(chapter)})"
    if profile == CI_PROFILE:
        return (f"**This page is the CI smoke run** (profile `{profile}`, the outputs `make test` compares): a grid "
                f"sized to check that the code runs, so its numbers and verdicts are not the study's. The study's "
                f"results are the reference book's (profile `{study}`, the one README reports): {there}.")
    return f"**This page holds profile `{profile}`'s results**, not the reference book's (profile `{study}`): {there}."


def show(profile: str, chapter: str) -> None:
    """A chapter's first cell: its banner, where it has one, and the notebook's setup."""
    from IPython.display import Markdown, display

    # tqdm.auto warns once, on import, that ipywidgets is missing, printing its own path: the build machine's folder
    # in every published chapter that imports it (aiconfigurator does), and nothing a reader can act on
    warnings.filterwarnings("ignore", message="IProgress not found")
    if banner := text(profile, chapter):
        display(Markdown(banner))
