"""The reference book: a profile's results as published with the repository, so that a reader sees what the study
found without running anything, and a rebuild on another machine says which verdicts it reproduces.

reference/<profile>/
    results/<experiment>.parquet   every stored row of the experiment's grid, as `results.load` returns them
    machine.json                   the limits measured on the machine that timed them (kvlib.study.limits)
    reference.json                 the commit, date and machine, and the verdicts the findings page drew from them
    chapters/<chapter>.ipynb       the book's executed chapters, rendered where the repository is browsed

`kvlib study --profile embedded --build --publish` writes it (and README's verdict section) from results/<profile>/ and
the notebooks the build executed. Where a profile has never been run on this checkout, its notebooks read the
reference instead of computing: opening one shows the published numbers, and `kvlib study` computes this machine's.
"""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from kvlib.errors import UserError
from kvlib.paths import machine_limits, read_from, repo_root
from kvlib.study import results
from kvlib.study.experiments import experiment, names

JSON_COLUMNS = b"kvlib_json_columns"  # parquet metadata: the object columns, stored as JSON text
README_PROFILE = "embedded"  # README shows the reference book of the profile `make book` builds


def folder(profile: str) -> Path:
    return repo_root() / "reference" / profile


def about(profile: str) -> dict | None:
    """reference.json of the profile's reference book; None where none is published."""
    path = folder(profile) / "reference.json"
    return json.loads(path.read_text()) if path.exists() else None


def stands_in(profile: str) -> bool:
    """Whether the profile's rows are read from its reference book (kvlib.paths.read_from says when)."""
    return read_from(profile) == folder(profile)


def load(profile: str, experiment: str) -> pd.DataFrame:
    path = folder(profile) / "results" / f"{experiment}.parquet"
    if not path.exists():
        return pd.DataFrame()
    table = pq.read_table(path)
    frame = table.to_pandas()
    for column in json.loads((table.schema.metadata or {}).get(JSON_COLUMNS, b"[]")):
        frame[column] = pd.Series([_decoded(json.loads(v)) for v in frame[column]], index=frame.index, dtype=object)
    return frame


def _plain(value):
    return value.tolist() if isinstance(value, np.ndarray) else value.item()  # numpy's arrays and scalars, for JSON


def _decoded(value):
    """A JSON value back as parquet gives it: a list is an array (of arrays, where it nests)."""
    if not isinstance(value, list):
        return value
    if any(isinstance(v, list) for v in value):
        out = np.empty(len(value), dtype=object)
        out[:] = [_decoded(v) for v in value]
        return out
    return np.asarray(value)


def _write_rows(frame: pd.DataFrame, path: Path) -> None:
    """One parquet file per experiment; its object columns (a task's int and str targets, a setting that is a bool in
    one policy's rows and missing in another's, per-layer arrays) as JSON text, so that they come back as they were."""
    objects = [c for c in frame.columns if frame[c].dtype == object]
    frame = frame.assign(**{c: [json.dumps(v, default=_plain) for v in frame[c]] for c in objects})
    table = pa.Table.from_pandas(frame, preserve_index=False)
    table = table.replace_schema_metadata({**table.schema.metadata, JSON_COLUMNS: json.dumps(objects).encode()})
    pq.write_table(table, path, compression="zstd")


def save(profile: str, gate: float) -> Path:
    """Publish results/<profile>/ and the verdicts the findings page draws from the published rows (at the profile's
    validity gate); its chapters follow once the build has executed them from it (save_chapters), so that its
    findings page knows itself for the reference book it becomes."""
    from kvlib.report.findings.verdicts import verdict_table
    from kvlib.report.study_rows import StudyRows

    out = folder(profile)
    if out.exists():
        shutil.rmtree(out)
    (out / "results").mkdir(parents=True)
    (out / "chapters").mkdir()
    for name in names():
        frame = results.load(profile, name)
        if not frame.empty:
            _write_rows(frame, out / "results" / f"{name}.parquet")
    published = {name: load(profile, name) for name in names()}  # each experiment's published rows, read once
    verdicts = verdict_table(StudyRows(published.__getitem__), gate)
    limits = machine_limits(profile)
    if limits.exists():
        shutil.copy(limits, out / "machine.json")
    computed = pd.concat([f[["finished_at", "git_sha", "device_name"]] for f in published.values() if "git_sha" in f])
    machine = json.loads(limits.read_text()) if limits.exists() else {}
    (out / "reference.json").write_text(json.dumps({
        "profile": profile, "published_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "published_from": results.commit(),
        "computed_between": [computed.finished_at.min(), computed.finished_at.max()],
        "computed_at_commits": sorted(computed.git_sha.dropna().unique().tolist()),
        "machine": {"cpu": machine.get("machine_cpu"), "host": machine.get("machine_host"),
                    "threads": machine.get("threads"), "device": ", ".join(sorted(computed.device_name.dropna().unique())),
                    "torch": machine.get("torch_version")},
        "verdicts": verdicts[["finding", "verdict", "numbers", "model"]].to_dict(orient="records"),
    }, indent=1) + "\n")
    return out


def unpack(profile: str) -> int:
    """The reference book's rows back in results/<profile>/ as the units they were, its machine's limits beside them,
    so that a run computes only what the reference lacks: its chapters executed, and republished, by this checkout's
    code from the very rows published (`kvlib study --from-reference`). Refused where results/<profile>/ holds rows
    already: a profile's rows never mix this machine's with the reference's. Returns the units written."""
    if about(profile) is None:
        raise UserError(f"reference/{profile}/ is not published: there is nothing to start from")
    if any((repo_root() / "results" / profile).glob("*/*.parquet")):
        raise UserError(f"results/{profile}/ holds rows already: starting from the reference would mix them with its "
                        f"rows; move results/{profile}/ aside first")
    units = 0
    for name in names():
        published = load(profile, name)
        if published.empty:  # an experiment the profile does not run
            continue
        for (key, repeat), rows in published.groupby(["point_hash", "repeat"]):
            results.write_unit(profile, name, key, int(repeat), rows.reset_index(drop=True))
            units += 1
    if (folder(profile) / "machine.json").exists():  # the limits of the machine that timed the rows, not this one's
        shutil.copy(folder(profile) / "machine.json", machine_limits(profile))
    return units


def save_chapters(profile: str) -> None:
    """The chapters the build executed (book/executed/), into the profile's published reference book."""
    for chapter in sorted((repo_root() / "book" / "executed").glob("*.ipynb")):
        shutil.copy(chapter, folder(profile) / "chapters" / chapter.name)


def is_own_build(profile: str, info: dict) -> bool:
    """Whether this checkout's results of the profile are the reference book's own rows (the build that publishes
    it): computed over the same span of time."""

    ends = [pd.read_parquet(f, columns=["finished_at"])["finished_at"] for e in names()
            for f in results.results_dir(profile, e).glob("*.parquet")]
    if not ends:
        return False
    stamps = pd.concat(ends).dropna()
    return [stamps.min(), stamps.max()] == list(info["computed_between"])


def provenance(info: dict) -> str:
    machine = info["machine"]
    day = info["computed_between"][1][:10]
    commits = ", ".join(info["computed_at_commits"])
    return (f"{info['profile']} profile, computed on {day} on a {machine['threads']}-thread {machine['cpu']} "
            f"({machine['host']}) at commit(s) {commits}")


def reproduction_markdown(profile: str, verdicts: pd.DataFrame) -> str:
    """The findings page's line on reproduction: which of this build's verdicts agree with the reference book's
    (nothing where the profile has no reference; a note where the page reads the reference itself)."""
    info = about(profile)
    if info is None:
        return ""
    if stands_in(profile):
        return (f"*This page reads the reference book's results ({provenance(info)}), published with the "
                f"repository: `kvlib study --profile {profile} --build` computes this machine's and then says which "
                "verdicts agree with these.*")
    if is_own_build(profile, info):
        return (f"*This page is the reference book ({provenance(info)}): a rebuild on another machine says here which "
                "of its verdicts agree with these.*")
    theirs = {r["finding"]: r["verdict"] for r in info["verdicts"]}
    lines = [f"**Reproduction.** These verdicts against the reference book's ({provenance(info)}):", "",
             "| # | this build | the reference book | |", "|---|---|---|---|"]
    for r in verdicts.itertuples():
        ref = theirs.get(r.finding, "not in the reference")
        same = "agrees" if _word(ref) == _word(r.verdict) else "**differs**"
        lines.append(f"| {r.finding} | {_word(r.verdict)} | {_word(ref)} | {same} |")
    return "\n".join(lines)


def _word(verdict: str) -> str:
    """The verdict's word, without the numbers some verdicts carry after a colon."""
    return verdict.split(":")[0].strip()


def models_sentence(profile: str) -> str:
    """Which model each experiment of the reference ran, how its weights are stored and run, and what "device" means
    there: read from its rows and its profile."""
    from kvlib.models.embedded import EMBEDDED_MODELS
    from kvlib.study import load_profile

    frames = [(name, load(profile, name)) for name in names()]
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


def readme_verdicts(profile: str) -> str:
    """README's first screen: the reference book's verdicts, its figure and where its pages are."""
    from kvlib.report.findings.verdicts import FINDINGS, family_sentence, verdict_markdown

    info = about(profile)
    table = pd.DataFrame(info["verdicts"]).assign(paper=lambda d: d.finding.map(FINDINGS))
    return "\n".join([
        (f"**What the study found**, in the reference book ({provenance(info)}): the paper's five findings and our "
         "verdicts, read from measurements by the rules of [the methods page](book/methods.md). Executed pages: "
         f"[findings](reference/{profile}/chapters/findings.ipynb), [every chapter](reference/{profile}/chapters/); "
         f"rows: [reference/{profile}/results/](reference/{profile}/results/). {models_sentence(profile)} "
         f"{family_sentence()}"),
        "",
        verdict_markdown(table, error_rate=False),
        "",
        f"![The study's trade-off in one picture](book/figures/overview-{profile}.png)",
    ])


CHOOSE_EXAMPLE = {"prompt_tokens": 1024, "batch": 16, "output_tokens": 16, "max_accuracy_drop": 5.0}  # on the grids


def readme_choose(profile: str) -> str:
    """README's `kvlib choose` example: a workload on the book's grid, and the answer the reference book gives."""
    from kvlib.report.choose.workload import choose
    from kvlib.report.study_rows import StudyRows
    from kvlib.study import load_profile

    w = CHOOSE_EXAMPLE
    answer = choose(StudyRows(lambda experiment: load(profile, experiment)), w["prompt_tokens"], w["batch"],
                    w["output_tokens"], w["max_accuracy_drop"], None, load_profile(profile).validity_gate)
    lines = answer.text().splitlines()
    shown = [line for line in lines if line.startswith(CHOOSE_SHOWN)]
    return "\n".join([
        "```bash", (f".venv/bin/python -m kvlib choose --profile {profile} --prompt-tokens {w['prompt_tokens']} "
                    f"--batch {w['batch']} --output-tokens {w['output_tokens']} "
                    f"--max-accuracy-drop {w['max_accuracy_drop']:g}"),
        "```", "", f"prints, from the reference book's rows ({provenance(about(profile))}), these lines among others:", "",
        "```text", *shown, "```", "",
        (f"The other {len(lines) - len(shown)} lines say what it ruled out and why, what it cannot tell at the items "
         "measured, where the workload differs from the grid, and the answer's error rate; the reference book's "
         f"[Which policy when](reference/{profile}/chapters/choose.ipynb) page gives its answers over the grid.")])


# the lines of the answer README shows: the picks (the rest is on the chooser page)
CHOOSE_SHOWN = ("Highest decode throughput:", "Lowest TTFT:", "Decode throughput of every qualifying policy:")


SECTIONS = {"verdicts": readme_verdicts, "choose": readme_choose}


def _markers(section: str) -> tuple[str, str]:
    return f"<!-- generated by kvlib study --publish: {section} -->", f"<!-- end of {section} -->"


def readme_section(section: str, profile: str) -> str:
    start, end = _markers(section)
    return f"{start}\n{SECTIONS[section](profile)}\n{end}"


def write_readme(profile: str) -> Path:
    """README's generated sections, from the profile's reference book."""
    path = repo_root() / "README.md"
    text = path.read_text()
    for section in SECTIONS:
        start, end = _markers(section)
        at, to = text.find(start), text.find(end)
        if at < 0 or to < 0:
            raise ValueError(f"README.md lacks the markers of its {section} section ({start} ... {end})")
        text = text[:at] + readme_section(section, profile) + text[to + len(end):]
    path.write_text(text)
    return path
