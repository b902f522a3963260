"""README's generated sections, from the published reference books (kvlib.study.reference): the verdict table, each
finding read from the book whose rows give its tested claims the most units (reference.strongest), and a `kvlib
choose` example from the book of README's profile. `kvlib study --publish` rewrites them between their markers."""

from __future__ import annotations

import pandas as pd

from kvlib.paths import repo_root
from kvlib.study import reference
from kvlib.study.experiments import experiment, names


def models_sentence(profile: str) -> str:
    """Which model each experiment of the reference ran, how its weights are stored and run, and what "device" means
    there: read from its rows and its profile."""
    from kvlib.models.embedded import EMBEDDED_MODELS
    from kvlib.study import load_profile

    frames = [(name, reference.load(profile, name)) for name in names()]
    by_model: dict[str, list[str]] = {}
    for name, frame in frames:
        for model in frame["model"].dropna().unique() if "model" in frame else ():
            by_model.setdefault(model, []).append(experiment(name).label)
    models = "; ".join(f"{EMBEDDED_MODELS[m].described if m in EMBEDDED_MODELS else m} for {', '.join(names)}"
                       for m, names in by_model.items())
    devices = sorted({d for _, frame in frames if "device_name" in frame for d in frame["device_name"].dropna()})
    capacity = load_profile(profile).device_capacity_gb
    device = (f"on the CPU, whose \"device memory\" is a configured {capacity:g} GB budget, not a GPU's"
              if devices == ["cpu"] and capacity else f"on {', '.join(devices)}")
    return f"Measured on {models}; {device}."


def verdict_rows() -> pd.DataFrame:
    """README's verdict table: each finding's verdict record from the book that reads it with the most units, and
    that book (`book`, None where no published book ran the finding)."""
    from kvlib.report.findings.verdicts import FINDINGS

    rows = []
    for finding, paper in FINDINGS.items():
        chosen = reference.strongest(finding)
        book, record = chosen or (None, {"finding": finding, "verdict": "not run in any published reference book"})
        rows.append({"model": None, "sample_n": None, "sample_of": None, **record, "paper": paper, "book": book})
    return pd.DataFrame(rows)


def _book(profile: str | None) -> str:
    return f"[{profile}](reference/{profile}/chapters/findings.ipynb)" if profile else "-"


def verdicts_section() -> str:
    """README's first screen: the published books' verdicts, where each is read, its figure and where its pages are."""
    from kvlib.report.findings.verdicts import CHECKS, family_sentence, verdict_markdown

    table = verdict_rows()
    books = list(dict.fromkeys(table.book.dropna()))
    tested = {b for b, f in zip(table.book, table.finding) if b and f not in CHECKS}
    pages = "; ".join(f"[findings](reference/{b}/chapters/findings.ipynb), [every chapter](reference/{b}/chapters/), "
                      f"rows [reference/{b}/results/](reference/{b}/results/)" for b in books)
    if len(books) == 1:
        where = f"in the reference book ({reference.provenances(books)})"
        models = models_sentence(books[0])
    else:
        where = (f"in the published reference books ({reference.provenances(books)}), each finding from the book "
                 f"whose rows give its tested claims the most units (a check from the {reference.README_PROFILE} book; "
                 "column *reference book*)")
        models = " ".join(f"The {b} book: {models_sentence(b)}" for b in books)
    return "\n".join([
        (f"**What the study found**, {where}: the paper's five findings and our verdicts, read from measurements by "
         f"the rules of [the methods page](book/methods.md). Executed pages: {pages}. {models} "
         f"{family_sentence(max(len(tested), 1))}"),
        "",
        verdict_markdown(table.assign(reference=table.book.map(_book)), error_rate=False),
        "",
        f"![The study's trade-off in one picture](book/figures/overview-{reference.README_PROFILE}.png)",
    ])


CHOOSE_EXAMPLE = {"prompt_tokens": 1024, "batch": 16, "output_tokens": 16, "max_accuracy_drop": 5.0}  # on the grids
# the lines of the answer README shows: the picks (the rest is on the chooser page)
CHOOSE_SHOWN = ("Highest decode throughput:", "Lowest TTFT:", "Decode throughput of every qualifying policy:")


def choose_section(profile: str = reference.README_PROFILE) -> str:
    """README's `kvlib choose` example: a workload on the book's grid, and the answer the reference book gives."""
    from kvlib.report.choose.workload import choose
    from kvlib.report.study_rows import StudyRows
    from kvlib.study import load_profile

    w = CHOOSE_EXAMPLE
    answer = choose(StudyRows(lambda experiment: reference.load(profile, experiment)), w["prompt_tokens"], w["batch"],
                    w["output_tokens"], w["max_accuracy_drop"], None, load_profile(profile).validity_gate)
    lines = answer.text().splitlines()
    shown = [line for line in lines if line.startswith(CHOOSE_SHOWN)]
    return "\n".join([
        "```bash", (f".venv/bin/python -m kvlib choose --profile {profile} --prompt-tokens {w['prompt_tokens']} "
                    f"--batch {w['batch']} --output-tokens {w['output_tokens']} "
                    f"--max-accuracy-drop {w['max_accuracy_drop']:g}"),
        "```", "", (f"prints, from the reference book's rows ({reference.provenance(reference.about(profile))}), "
                    "these lines among others:"), "",
        "```text", *shown, "```", "",
        (f"The other {len(lines) - len(shown)} lines say what it ruled out and why, what it cannot tell at the items "
         "measured, where the workload differs from the grid, and the answer's error rate; the reference book's "
         f"[Which policy when](reference/{profile}/chapters/choose.ipynb) page gives its answers over the grid.")])


SECTIONS = {"verdicts": verdicts_section, "choose": choose_section}


def _markers(section: str) -> tuple[str, str]:
    return f"<!-- generated by kvlib study --publish: {section} -->", f"<!-- end of {section} -->"


def section_text(section: str) -> str:
    start, end = _markers(section)
    return f"{start}\n{SECTIONS[section]()}\n{end}"


def write() -> None:
    """README's generated sections, from the published reference books."""
    path = repo_root() / "README.md"
    text = path.read_text()
    for section in SECTIONS:
        start, end = _markers(section)
        at, to = text.find(start), text.find(end)
        if at < 0 or to < 0:
            raise ValueError(f"README.md lacks the markers of its {section} section ({start} ... {end})")
        text = text[:at] + section_text(section) + text[to + len(end):]
    path.write_text(text)
