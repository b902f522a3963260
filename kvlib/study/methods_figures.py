"""The methods page's figures that the code holds (rounds, levels, the validity gate, sizes), generated from the
profiles and the statistics' declarations and written between markers in book/methods.md, as README's generated
sections are: a figure typed by hand drifts from the code that decides it (the page once said 8 rounds where the
profile ran 10, and a gate of 0.5 where the code's was 0.70). `write` refreshes the sections (the book's build runs
it); tests/study/test_methods_figures.py fails when the page is stale."""

from __future__ import annotations

import re
from pathlib import Path

from kvlib.paths import repo_root
from kvlib.report import stats
from kvlib.report.gate import GATE
from kvlib.report.pages import ACCURACY, CHOOSER, FINDINGS, SERVING, TIMING
from kvlib.report.stats.accuracy import TAIL_REPLICATES, draws_for
from kvlib.study.experiments import REGISTRY, experiment, names
from kvlib.study.profile import load_profile

TIMED = names(systems=True)  # the experiments whose timings the by-round test reads
SIZED = ("embedded", "confirmatory")
BOOKS = ("embedded", "paper", "paper-shapes")  # the profiles whose books read timings: always in the table of rounds  # the offline profiles whose accuracy and retention settle findings 4 and 5
# sections that settle several tests at their whole share (kvlib.report.pages says which): finding 2's claims by Holm,
# the chooser's ties by the comparison with the best; every other section divides its share among its intervals
STEPWISE = {("findings", "finding 2"), ("chooser answer", "decode"), ("chooser answer", "TTFT")}


def _profile(name: str):
    return load_profile(name, repo_root())


def threshold(name: str) -> tuple[float, str]:
    """The least p-value an experiment's timings must reach for its tested statement: where its rows test a finding
    of the findings page's family (batch scaling's finding 2), Holm's first threshold over that finding's declared
    claims at its share of the page; else its chapter's lead at its page's 5 %."""
    claims = dict(FINDINGS.weights)
    for finding in (f"finding {n}" for n in experiment(name).findings if f"finding {n}" in claims):
        first = FINDINGS.share(finding) / claims[finding]
        return first, f"{finding}: Holm's first threshold, {FINDINGS.share(finding):.2%} / {claims[finding]} claims"
    return TIMING.share("the lead"), "its chapter's lead"


def can_settle(rounds: int, name: str) -> bool:
    """Whether the by-round test at `rounds` can ever reach the experiment's threshold (its smallest p-value, 2 / 2^n,
    at or under it)."""
    return stats.smallest_p_value(rounds, rounds, paired=True) <= threshold(name)[0]


def rounds() -> str:
    head = ("| profile | experiment | rounds | smallest p-value | its test: threshold | can settle | real size at "
            f"{stats.ALPHA:.0%}, coverage |")
    rows = [head, "|---|---|---|---|---|---|---|"]
    names = sorted(p.stem for p in (repo_root() / "params").glob("*.yaml"))
    checks = []  # the profiles that check code paths: named, not tabled, where none of their rounds can settle
    for name in names:
        profile = _profile(name)
        timed = [e for e in TIMED if e in profile.experiments]
        if name not in BOOKS and timed and not any(can_settle(profile.repeats(e), e) for e in timed):
            checks.append(f"`{name}`")
            continue
        for timed_name in (e for e in TIMED if e in profile.experiments):
            n = profile.repeats(timed_name)
            first, what = threshold(timed_name)
            size = (f"{stats.attained_size(n, n, stats.ALPHA, paired=True):.1%}, "
                    f"{1 - stats.attained_size(n, n, stats.ALPHA, paired=True):.1%}"
                    if n >= stats.repeats_needed(stats.ALPHA, paired=True) else "never rejects; no interval")
            rows.append(f"| `{name}` | {timed_name} | {n} | {stats.smallest_p_value(n, n, paired=True):.4f} | "
                        f"{what}: {first:.4f} | {'yes' if can_settle(n, timed_name) else 'no'} | {size} |")
    return "\n".join([
        (f"Each profile's rounds (`repeats` in `params/<profile>.yaml`) and what the by-round test can settle at them: "
         f"n rounds give a smallest p-value of 2 / 2^n ({stats.repeats_needed(stats.ALPHA, paired=True)} are the "
         f"fewest that can reject at {stats.ALPHA:.0%}), and a test run at {stats.ALPHA:.0%} really rejects at the "
         f"largest step under it (its real size; its intervals cover one minus that). \"no\": no statement of that "
         f"experiment can be settled at these rounds, and its chapter says so."), "", *rows]
        + (["", f"{' and '.join(checks)} check code paths: none of their rounds can settle a statement."]
           if checks else []))


def families() -> str:
    rows = ["| page (`kvlib.report.pages`) | section | declared weight | share | how it is spent |", "|---|---|---|---|---|"]
    for page in (FINDINGS, ACCURACY, CHOOSER, SERVING, TIMING):
        for section, weight in page.weights:
            share = page.share(section)
            if page is TIMING:
                how = f"its one tested statement at {share:.2%}"
            elif (page.page, section) in STEPWISE:
                how = (f"Holm over its {weight} claims: first threshold {share / weight:.4f}" if page is FINDINGS
                       else f"the comparison with the best at {share:.2%}, its pick allowed for")
            elif page is FINDINGS:
                how = f"{weight} claims, each interval at {page.level(section):.2%}"
            else:
                how = "shared equally among its intervals, each printed with its level"
            rows.append(f"| {page.page} | {section} | {weight} | {share:.2%} | {how} |")
    level = FINDINGS.level("finding 4")
    return "\n".join([
        f"The pages' families: each page's {stats.ALPHA:.0%} divided among its sections by their declared weights.",
        "", *rows, "",
        (f"The validity gate's default: the full cache right on {GATE:.0%} of a task's items (`kvlib.report.gate`; "
         f"a profile's `validity_gate`). Equivalence: accuracy within +-{stats.EQUIVALENCE_MARGIN * 100:g} pp, timing "
         f"within +-{stats.EQUIVALENCE_TIMING:.0%}. Bootstrap: at least {stats.DRAWS:,} draws, and at least "
         f"{TAIL_REPLICATES} replicates beyond each end of an interval: {draws_for(1 - stats.ALPHA):,} "
         f"draws at {1 - stats.ALPHA:.0%}, {draws_for(level):,} at a findings claim's {level:.2%}.")])


def sizes() -> str:
    """Each sized profile's rows of the experiments that declare their sizes (Experiment.sizes)."""
    sized = [e for e in REGISTRY.values() if e.sizes]
    rows = ["| profile | experiment | policies | budgets | size |", "|---|---|---|---|---|"]
    for name in SIZED:
        spec = _profile(name).experiments
        rows += [row for e in sized if e.name in spec for row in e.sizes(name, spec[e.name])]
    return "\n".join([f"The {' and '.join(e.label for e in sized)} experiments' sizes, from the profiles:", "", *rows])


SECTIONS = {"rounds": rounds, "families": families, "sizes": sizes}
PAGE = Path("book") / "methods.md"


def markers(section: str) -> tuple[str, str]:
    return f"<!-- generated by kvlib.study.methods_figures: {section} -->", f"<!-- end of {section} -->"


def section(name: str) -> str:
    start, end = markers(name)
    return f"{start}\n{SECTIONS[name]()}\n{end}"


def current(text: str, name: str) -> str | None:
    """The section as the page holds it, markers included (None: the page lacks its markers)."""
    start, end = markers(name)
    found = re.search(re.escape(start) + ".*?" + re.escape(end), text, re.DOTALL)
    return found.group(0) if found else None


def write() -> Path:
    path = repo_root() / PAGE
    text = path.read_text()
    for name in SECTIONS:
        if current(text, name) is None:
            raise ValueError(f"{PAGE} lacks the markers of its {name} section ({' ... '.join(markers(name))})")
        text = text.replace(current(text, name), section(name))
    path.write_text(text)
    return path
