"""The book: each chapter notebook executed by papermill with its parameters (it reads results/ and computes
nothing), then jupyter-book over the executed copies. The executed copies show code one click away: input hidden,
and the parameters papermill injects not shown at all."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import yaml

from kvlib.study.experiments import experiment, names
from kvlib.study.results import repo_root

# a chapter an experiment, then those that read every experiment
CHAPTERS = (*names(), "paper_scale", "choose", "findings")
HIDDEN = {"parameters", "injected-parameters"}


def chapters_for(run: list[str], experiments: list[str]) -> list[str]:
    """The chapters a build executes: those of the experiments it ran (run), and those that read across experiments
    where the profile (experiments) has what they read: the chooser answers from timings, so a profile without a
    timed experiment gets none (its page would be tables of dashes)."""
    timed = any(experiment(e).timed for e in experiments)
    return [chapter for chapter in CHAPTERS if chapter in run
            or chapter not in names() and (chapter != "choose" or timed)]


def execute_all(chapters: list[str], profile: str) -> list[Path]:
    """Each chapter executed (execute), as many at once as there are CPUs: a chapter is a kernel of its own that
    reads results and draws, one core's work (four chapters took 28 s side by side on two cores, 47 s one after
    another: benchmarks/README.md). The chapters that read every experiment (the longest) start first. Returns the
    executed copies in `chapters`' order."""
    order = sorted(chapters, key=lambda chapter: chapter in names())
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # (the pool starts no more threads than chapters)
        done = dict(zip(order, pool.map(lambda chapter: execute(chapter, profile), order)))
    return [done[chapter] for chapter in chapters]


def execute(notebook: str, profile: str) -> Path:
    import papermill

    root = repo_root()
    out = root / "book" / "executed" / f"{notebook}.ipynb"
    out.parent.mkdir(parents=True, exist_ok=True)
    papermill.execute_notebook(str(root / "notebooks" / f"{notebook}.ipynb"), str(out),
                               parameters={"profile": profile, "compute_missing": False},
                               cwd=str(root / "notebooks"), progress_bar=False)
    for_reading(out)
    return out


def for_reading(path: Path) -> None:
    """Tag the executed notebook's cells for the book: parameter cells removed, every other code cell's input
    hidden behind a click (jupyter-book's `hide-input`); papermill's record of where it read and wrote the notebook
    made relative to the checkout (a published chapter names no build machine's folders)."""
    nb = nbformat.read(path, as_version=4)
    record = nb.metadata.get("papermill", {})
    for key in ("input_path", "output_path"):
        if record.get(key):
            record[key] = str(Path(record[key]).relative_to(repo_root()))
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        tags = set(cell.metadata.get("tags", []))
        tags |= {"remove-cell"} if tags & HIDDEN else {"hide-input"}
        cell.metadata["tags"] = sorted(tags)
    nbformat.write(nb, path)


def write_overview(profile: str, validity_gate: float) -> Path | None:
    """The findings page's overview figure as a PNG beside the book's sources (book/figures/overview-<profile>.png),
    for the README and anyone who wants the study's answer in one picture; drawn from the stored results alone. None,
    and no file, where the profile has nothing to draw (no batch-scaling results)."""
    import matplotlib.pyplot as plt

    from kvlib.report.findings.overview import overview
    from kvlib.report.study_rows import StudyRows
    from kvlib.study import results

    out = repo_root() / "book" / "figures" / f"overview-{profile}.png"
    fig = overview(StudyRows(lambda name: results.load(profile, name)), validity_gate)
    if fig is None:
        out.unlink(missing_ok=True)  # a figure left by an earlier run of other rows would stand for these
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_fidelity() -> Path:
    """The methods page's fidelity table (book/fidelity.md, included there), from the policies' declarations."""
    from kvlib.policies import REGISTRY, fidelity

    path = repo_root() / "book" / "fidelity.md"
    path.write_text(fidelity.markdown(REGISTRY))
    return path


def write_profile_guide() -> Path:
    """The profile guide (book/profiles.md), from the schema, the experiments and the runners' settings."""
    from kvlib.study import profile_guide

    path = repo_root() / "book" / "profiles.md"
    path.write_text(profile_guide.markdown() + "\n")
    return path


def executed_for(profile: str) -> list[str]:
    """The executed chapters (book/executed/) that read `profile`, by the parameters papermill recorded in each:
    the folder keeps each chapter as whichever profile's build executed it last."""
    out = []
    for path in sorted((repo_root() / "book" / "executed").glob("*.ipynb")):
        parameters = nbformat.read(path, as_version=4).metadata.get("papermill", {}).get("parameters", {})
        if parameters.get("profile") == profile:
            out.append(path.stem)
    return out


def toc_for(profile: str) -> Path:
    """book/_toc.yml with only the profile's executed chapters (a profile without a TTFT experiment has no TTFT page,
    and must not show another profile's), written beside the build (book/_build/)."""
    root = repo_root() / "book"
    toc = yaml.safe_load((root / "_toc.yml").read_text())
    own = {f"executed/{chapter}" for chapter in executed_for(profile)}
    toc["chapters"] = [c for c in toc["chapters"] if not c["file"].startswith("executed/") or c["file"] in own]
    out = root / "_build" / f"_toc-{profile}.yml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(toc, sort_keys=False))
    return out


def build(profile: str) -> None:
    from kvlib.study import methods_figures

    write_fidelity()
    write_profile_guide()
    methods_figures.write()
    subprocess.run(["jupyter-book", "build", str(repo_root() / "book"), "--toc", str(toc_for(profile))], check=True,
                   env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
