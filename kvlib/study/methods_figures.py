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
from kvlib.study.experiments import names
from kvlib.study.profile import load_profile

TIMED = names(systems=True)  # the experiments whose timings the by-round test reads
SIZED = ("embedded", "confirmatory")
BOOKS = ("embedded", "paper", "paper-shapes")  # the profiles whose books read timings: always in the table of rounds  # the offline profiles whose accuracy and retention settle findings 4 and 5
# sections that settle several tests at their whole share (kvlib.report.pages says which): finding 2's claims by Holm,
# the chooser's ties by the comparison with the best; every other section divides its share among its intervals
STEPWISE = {("findings", "finding 2"), ("chooser answer", "decode"), ("chooser answer", "TTFT")}


def _profile(name: str):
    return load_profile(name, repo_root())


def threshold(experiment: str) -> tuple[float, str]:
    """The least p-value an experiment's timings must reach for its tested statement: batch scaling carries finding 2
    (Holm over its declared claims at its share of the findings page), a timing chapter's lead its page's 5 %."""
    if experiment == "batch_scaling":
        claims = dict(FINDINGS.weights)["finding 2"]
        first = FINDINGS.share("finding 2") / claims
        return first, f"finding 2: Holm's first threshold, {FINDINGS.share('finding 2'):.2%} / {claims} claims"
    return TIMING.share("the lead"), "its chapter's lead"


def can_settle(rounds: int, experiment: str) -> bool:
    """Whether the by-round test at `rounds` can ever reach the experiment's threshold (its smallest p-value, 2 / 2^n,
    at or under it)."""
    return stats.smallest_p_value(rounds, rounds, paired=True) <= threshold(experiment)[0]


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
        for experiment in (e for e in TIMED if e in profile.experiments):
            n = profile.repeats(experiment)
            first, what = threshold(experiment)
            size = (f"{stats.attained_size(n, n, stats.ALPHA, paired=True):.1%}, "
                    f"{1 - stats.attained_size(n, n, stats.ALPHA, paired=True):.1%}"
                    if n >= stats.repeats_needed(stats.ALPHA, paired=True) else "never rejects; no interval")
            rows.append(f"| `{name}` | {experiment} | {n} | {stats.smallest_p_value(n, n, paired=True):.4f} | "
                        f"{what}: {first:.4f} | {'yes' if can_settle(n, experiment) else 'no'} | {size} |")
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


def _items(fixed: dict, task: str) -> str:
    """A task's items per point as a profile's fixed values set them (`limit` takes the first items)."""
    offline, ruler = fixed.get("offline_tasks") or {}, fixed.get("ruler") or {}
    if task == "kvlib_recall" and "recall_items" in offline:
        n = offline["recall_items"] * len(offline.get("recall_lengths", [None]))
    elif task.startswith(("niah_", "ruler_")) and "items" in ruler:
        n = ruler["items"] * len(ruler.get("max_seq_lengths", [None]))
    else:
        n = None
    limit = fixed.get("limit")
    n = min(n, limit) if n and limit else n or limit
    return f"{task}: {n:,} items" if n else f"{task}: every item"


def _arm_row(name: str, accuracy: dict, arm: dict) -> str:
    """An accuracy arm's row: its policies and what sets them apart (rule, alpha, protocol, model), budgets, items."""
    fixed = {**accuracy["fixed"], **arm.get("fixed", {})}
    grid = arm.get("grid", {})
    apart = [f"{k} {fixed[k]:g}" if isinstance(fixed[k], float) else f"{k} {fixed[k]}"
             for k in ("protocol", "budget_rule", "alpha") if k in arm.get("fixed", {})]
    model = f"; {arm['model']}" if arm.get("model") else ""
    label = f"accuracy ({', '.join(apart)}{model}{', exploratory' if arm.get('role') == 'exploratory' else ''})"
    budgets = ", ".join(f"{b:g}" for b in grid.get("budget", []))
    items = fixed.get("limit")
    tasks = ", ".join(grid.get("task", []))
    return (f"| `{name}` | {label} | {', '.join(arm['policies'])} | {budgets} | "
            f"{tasks}: {f'{items:,} items' if items else 'every item'} each, paired |")


def sizes() -> str:
    rows = ["| profile | experiment | policies | budgets | size |", "|---|---|---|---|---|"]
    for name in SIZED:
        spec = _profile(name).experiments
        if "accuracy" in spec:
            accuracy, exploratory = spec["accuracy"], spec["accuracy"].get("exploratory") or {}
            tasks, budgets = accuracy["grid"]["task"], ", ".join(f"{b:g}" for b in accuracy["grid"]["budget"])
            tested = [p for p in accuracy["policies"] if p not in exploratory.get("policies", [])]
            rows.append(f"| `{name}` | accuracy | {', '.join(tested)} | {budgets} | "
                        + "; ".join(_items(accuracy["fixed"], t) for t in tasks) + ", paired |")
            if exploratory:
                fixed = {**accuracy["fixed"], **exploratory.get("fixed", {})}
                rows.append(f"| `{name}` | accuracy (exploratory) | {', '.join(exploratory['policies'])} | {budgets} | "
                            + "; ".join(_items(fixed, t) for t in tasks) + ", paired |")
            rows += [_arm_row(name, accuracy, arm) for arm in accuracy.get("arms") or []]
        if "retention" in spec:
            retention = spec["retention"]
            fixed, budgets = retention["fixed"], ", ".join(f"{b:g}" for b in retention["grid"]["budget"])
            if retention["grid"].get("budget_rule"):
                budgets += f" (H2O's budget rule: {', '.join(retention['grid']['budget_rule'])})"
            buckets = fixed["buckets"]
            protocols = fixed.get("protocol", "deployed")
            rows.append(f"| `{name}` | retention | {', '.join(retention['policies'])} | {budgets} | "
                        f"{len(buckets) * fixed['per_bucket']} conversations a policy ({fixed['per_bucket']} in each "
                        f"of {len(buckets)} buckets: " + ", ".join(f"{lo:,}-{hi:,}" for lo, hi in buckets)
                        + " tokens), questions after turns " + ", ".join(map(str, fixed["query_turns"]))
                        + "; " + (", ".join(protocols) if isinstance(protocols, list) else protocols) + " |")
    return "\n".join(["The accuracy and retention experiments' sizes, from the profiles:", "", *rows])


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
