"""The whole study, one way: profile -> points -> results -> notebooks -> book.

`kvlib study --profile P` computes every missing unit of P's experiments (kvlib.study.executor), then executes each
chapter's notebook with papermill (it only reads results/) and builds the book. A notebook opened interactively on
a profile whose results are missing computes them through the same executor, with a progress bar, unless the
profile was never run here and its reference book is published (then it reads that).
"""

from __future__ import annotations

import pandas as pd

from kvlib.errors import UserError
from kvlib.study import book, estimate, readme, reference, results
from kvlib.study.executor import Executor, UnitsFailed, run_experiment, units_to_compute
from kvlib.study.experiments import names as experiment_names
from kvlib.study.limits import measure
from kvlib.study.profile import Profile
from kvlib.study.profile import load_profile as _load_profile


def load_profile(name_or_path: str, device: str | None = None, toy: bool = False) -> Profile:
    """params/<name>.yaml of this checkout, or a path to a YAML file; on another device, or at its toy size
    (kvlib.study.overrides)."""
    return _load_profile(name_or_path, results.repo_root(), device, toy)


def run_study(profile: str, experiments: list[str] | None = None, force: bool = False, build: bool = False,
              policies: list[str] | None = None, notebooks: bool = True, executor: Executor | None = None,
              device: str | None = None, toy: bool = False, publish: bool = False, workers: int = 1,
              from_reference: bool = False) -> None:
    """device, toy: the profile on another device or at its toy size, its results in a folder of their own
    (kvlib.study.overrides); results only, since the book's notebooks read a profile by its file's name.
    publish: then publish the results and the executed chapters as the profile's reference book, and README's verdict
    section from it (kvlib.study.reference). workers: processes an untimed experiment's units share
    (kvlib.study.executor.Processes). from_reference: first put the published reference's rows in results/<profile>/
    (kvlib.study.reference.unpack), so that only what it lacks is computed."""
    prof = load_profile(profile, device, toy)
    if prof.name != load_profile(profile).name and (notebooks or build):
        raise UserError("--device and --toy store results only: add --compute-only (the book's notebooks read a "
                        "profile by its file's name; for a book of your own size, write a profile)")
    if publish and (not notebooks or experiments or policies):
        raise UserError("--publish publishes the whole profile and the chapters the run executes from it: drop "
                        "--compute-only, --experiments and --policies")
    if from_reference:
        print(f"{prof.name}: {reference.unpack(prof.name)} units from reference/{prof.name}/", flush=True)
    names = experiments or [e for e in experiment_names() if e in prof.experiments]
    if said := estimate.announce(prof.name, {n: units_to_compute(prof, n, force, policies) for n in names
                                             if n in prof.experiments}, measure):
        print(said, flush=True)
    failed = []
    for name in names:  # a unit that fails stops nothing: the other experiments are computed before the run fails
        try:
            run_experiment(prof, name, force=force, policies=policies, executor=executor, workers=workers)
        except UnitsFailed as exc:
            failed.append(exc)
    if failed:
        raise UnitsFailed([f for exc in failed for f in exc.failures], sum(exc.total for exc in failed))
    if publish:  # before the chapters: the findings page then reads itself as the reference book it becomes
        reference.save(prof.name, prof.validity_gate)
    executed = []
    if notebooks:
        executed = book.execute_all(book.chapters_for(names, prof.experiments), prof.name)
        book.write_overview(prof.name, prof.validity_gate)
    if build:
        book.build(prof.name)
    if publish:
        reference.save_chapters(prof.name, executed)
        readme.write()  # its verdicts read every published book, this one's included


def stored(profile: str, experiment: str) -> pd.DataFrame:
    """The profile's stored rows, computing nothing: this checkout's, or its reference book's where that stands in
    (kvlib.study.reference)."""
    return reference.load(profile, experiment) if reference.stands_in(profile) else results.load(profile, experiment)


def load(profile: str, experiment: str, compute_missing: bool = True) -> pd.DataFrame:
    """A notebook's results: the stored rows of the profile's grid. Where units are missing, they are computed here
    (with a progress bar) if compute_missing, else the rows stored so far come back with a note of what is not.
    A profile never run on this checkout whose reference book is published reads the reference (kvlib.study.reference)
    and computes nothing."""
    if reference.stands_in(profile):
        print(f"{profile}/{experiment}: the reference book's rows ({reference.provenance(reference.about(profile))}); "
              f"`kvlib study --profile {profile} --experiments {experiment} --compute-only` computes this machine's")
        return reference.load(profile, experiment)
    missing = results.missing_units(profile, experiment)
    if missing is None and experiment not in load_profile(profile).experiments:
        print(f"{profile}: the profile has no {experiment} experiment")  # (the paper's, say, has no offload grid)
    elif missing is None or missing:
        command = f"kvlib study --profile {profile} --experiments {experiment} --compute-only"
        count = "no results" if missing is None else f"{len(missing)} unit(s) missing"
        if not compute_missing:
            print(f"{profile}/{experiment}: {count}; `{command}` computes them")
        else:
            print(f"{profile}/{experiment}: {count}; computing them now, as `{command}` would")
            run_experiment(load_profile(profile), experiment)
    return results.load(profile, experiment)
