"""The reference book: a profile's results as published with the repository, so that a reader sees what the study
found without running anything, and a rebuild on another machine says which verdicts it reproduces.

reference/<profile>/
    results/<experiment>.parquet   every stored row of the experiment's grid, as `results.load` returns them
    machine.json                   the limits measured on the machine that timed them (kvlib.study.limits)
    reference.json                 the commit, date and machine, and the verdicts the findings page drew from them
    chapters/<chapter>.ipynb       the book's executed chapters, rendered where the repository is browsed

`kvlib study --profile embedded --build --publish` writes it from results/<profile>/ and the notebooks the build
executed (and README's sections from every published book: kvlib.study.readme). Where a profile has never been run on
this checkout, its notebooks read the reference instead of computing: opening one shows the published numbers, and
`kvlib study` computes this machine's.
"""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from kvlib.errors import UserError
from kvlib.paths import machine_limits, read_from, repo_root
from kvlib.study import results
from kvlib.study.experiments import names

VERDICT_FIELDS = ["finding", "verdict", "numbers", "model", "sample_n", "sample_of"]  # of each, in reference.json
JSON_COLUMNS = b"kvlib_json_columns"  # parquet metadata: the object columns, stored as JSON text
README_PROFILE = "embedded"  # the book of the profile `make book` builds: README's choose example, its checks


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
    about_run = ["finished_at", "git_sha", "device_name", "machine_cpu", "machine_host", "cpu_threads", "unit_workers",
                 "torch_version"]
    computed = pd.concat([f[[c for c in about_run if c in f]] for f in published.values() if "git_sha" in f])
    (out / "reference.json").write_text(json.dumps({
        "profile": profile, "published_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "published_from": results.commit(),
        "computed_between": [computed.finished_at.min(), computed.finished_at.max()],
        "computed_at_commits": sorted(computed.git_sha.dropna().unique().tolist()),
        "machine": _machine(json.loads(limits.read_text()) if limits.exists() else {}, computed),
        "verdicts": verdicts[VERDICT_FIELDS].to_dict(orient="records"),
    }, indent=1) + "\n")
    return out


def _machine(limits: dict, rows: pd.DataFrame) -> dict:
    """The machine a book was computed on: its measured limits where a timed experiment recorded them, else what its
    rows say (a profile of untimed experiments only, as the confirmatory one: the threads its units used together)."""
    def rows_say(column: str) -> str | None:
        return (", ".join(sorted(rows[column].dropna().astype(str).unique())) or None) if column in rows else None

    workers = rows["unit_workers"].fillna(1) if "unit_workers" in rows else 1
    threads = (rows["cpu_threads"] * workers).max() if "cpu_threads" in rows else None
    return {"cpu": limits.get("machine_cpu") or rows_say("machine_cpu"),
            "host": limits.get("machine_host") or rows_say("machine_host"),
            "threads": limits.get("threads") or (int(threads) if pd.notna(threads) else None),
            "device": rows_say("device_name"), "torch": limits.get("torch_version") or rows_say("torch_version")}


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


def save_chapters(profile: str, chapters: list[Path]) -> None:
    """The chapters this run executed, into the profile's published reference book: never all of book/executed/,
    which keeps chapters another profile's build executed (the embedded book's TTFT page in the confirmatory book)."""
    for chapter in chapters:
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


def published() -> list[str]:
    """The profiles whose reference book is published: README's first, then by name."""
    names_ = sorted(p.parent.name for p in (repo_root() / "reference").glob("*/reference.json"))
    return sorted(names_, key=lambda profile: profile != README_PROFILE)


def strongest(finding: int) -> tuple[str, dict] | None:
    """The published reference book whose verdict on the finding rests on the most units (its claims' fewest,
    `sample_n`), README's on a tie or where none counts any: its profile and verdict record. Chosen by the books'
    sizes, never by what they found; None where no book ran the finding."""
    from kvlib.report.findings.verdicts import NOT_RUN

    ran = [(profile, record) for profile in published() for record in about(profile)["verdicts"]
           if record["finding"] == finding and not record["verdict"].startswith(NOT_RUN)]
    return max(ran, key=lambda book: book[1].get("sample_n") or 0, default=None)  # max keeps the first of a tie


class Borrowed(NamedTuple):
    """The rows a reading reads, at their book's validity gate; `book` and `note` name the book where they are not the
    profile's own."""

    rows: pd.DataFrame
    gate: float
    note: str | None = None
    book: str | None = None


def rows_for(profile: str, experiment: str, rows: pd.DataFrame, gate: float, reads) -> Borrowed:
    """The rows a reading (`reads(rows)`: whether it can read them) reads: the profile's own where it can, else the
    first other published book's it can, said so (the embedded book runs one model within its hour, the confirmatory
    book's size arms three)."""
    from kvlib.study import load_profile

    if not reads(rows):
        for book in published():
            if book != profile and reads(theirs := load(book, experiment)):
                return Borrowed(theirs, load_profile(book).validity_gate,
                                f"This section reads the {book} reference book's rows ({provenance(about(book))}), at "
                                f"its validity gate: this profile's rows cannot give it.", book)
    return Borrowed(rows, gate)


def reproduction_markdown(profile: str, verdicts: pd.DataFrame) -> str:
    """The findings page's line on reproduction: which of this build's verdicts agree with each published reference
    book's, its own profile's and the others' (nothing where the profile has no reference; where the page reads its
    reference, or is it, the other books only)."""
    info = about(profile)
    if info is None:
        return ""
    others = [p for p in published() if p != profile]
    if not stands_in(profile) and not is_own_build(profile, info):
        books = [profile, *others]
        whose = "the reference book's" if len(books) == 1 else "the published reference books'"
        return "\n".join([f"**Reproduction.** These verdicts against {whose} ({provenances(books)}):", "",
                          _agreement_table(verdicts, books)])
    if stands_in(profile):
        lead = (f"*This page reads the reference book's results ({provenance(info)}), published with the "
                f"repository: `kvlib study --profile {profile} --build` computes this machine's and then says which "
                "verdicts agree with these.*")
    else:
        lead = (f"*This page is the reference book ({provenance(info)}): a rebuild on another machine says here which "
                "of its verdicts agree with these.*")
    if not others:
        return lead
    return "\n".join([f"{lead} Against the other published reference books ({provenances(others)}):", "",
                      _agreement_table(verdicts, others)])


def provenances(books: list[str]) -> str:
    return "; ".join(provenance(about(book)) for book in books)


def _agreement_table(verdicts: pd.DataFrame, books: list[str]) -> str:
    """| # | this build | each book's verdict | whether this build agrees with it |; a finding one side did not run
    is not compared."""
    from kvlib.report.findings.verdicts import NOT_RUN

    theirs = {book: {r["finding"]: _word(r["verdict"]) for r in about(book)["verdicts"]} for book in books}
    lines = ["| # | this build |" + "".join(f" the {book} reference book | this build against it |" for book in books),
             "|---|---|" + "---|---|" * len(books)]
    for r in verdicts.itertuples():
        ours, cells = _word(r.verdict), ""
        for book in books:
            ref = theirs[book].get(r.finding, NOT_RUN)
            same = "-" if NOT_RUN in (ours, ref) else "agrees" if ref == ours else "**differs**"
            cells += f" {'not run there' if ref == NOT_RUN else ref} | {same} |"
        lines.append(f"| {r.finding} | {ours} |{cells}")
    return "\n".join(lines)


def _word(verdict: str) -> str:
    """The verdict's word, without the numbers some verdicts carry after a colon."""
    return verdict.split(":")[0].strip()
