"""What the timing chapters (TTFT, batch scaling, decode length, serving) share: a lead naming the best runner and the
next with the timing rule's interval, ratios described with it, the rule said once, rows read per kind of machine.
None ranks: a ranking is a claim of the findings' declared family (kvlib.report.findings.verdicts)."""

from __future__ import annotations

import pandas as pd

from kvlib.report import stats
from kvlib.report.measures import geometric_mean, machine_kind


def best_and_next(runs: dict[str, pd.DataFrame], value: str,
                  higher: bool) -> tuple[str, str | None, stats.TimingComparison | None]:
    """The runner with the best geometric mean of `value`, the next, and the first against the next."""
    centres = {k: geometric_mean(g[value]) for k, g in runs.items()}
    ranked = sorted(centres, key=lambda k: centres[k], reverse=higher)
    if len(ranked) < 2:
        return ranked[0], None, None
    first, second = ranked[:2]
    return first, second, stats.compare_timings(stats.by_round(runs[first], value), stats.by_round(runs[second], value))


def led(first: str, second: str | None, c: stats.TimingComparison | None, claim: str, figure: str, what: str) -> str:
    """The chapter's lead, worded by the comparison's verdict: `first` `claim` (e.g. "decodes fastest") only where the
    timing rule tells it from the runner-up; else the two are named as not told apart, at the repeats there were."""
    if c is None:
        return f"{first} ({figure})"
    interval = f"interval {c.low:.2f}-{c.high:.2f}x" if c.judged else "too few repeats for an interval"
    versus = f"{c.ratio:.2f}x {second}'s {what} ({interval})"
    if c.verdict in (stats.LARGER, stats.SMALLER):
        return f"{first} {claim} ({figure}), {versus}"
    n = min(c.n_a, c.n_b)
    told = "not distinguishable" if c.judged else f"not told apart at {n} repeat{'s' * (n != 1)}"
    return f"{first} and {second} are {told}: {first} {figure}, {versus}"


def oom_line(df: pd.DataFrame, by: list[str], axis: str, at) -> str:
    """Where each runner ran out of the device memory (at(x) names a grid value: "4,096 tokens", "batch 16")."""
    failed = df[df["oom"].astype(bool)]
    if failed.empty:
        return "Every runner completed every point of the grid within the device memory."
    walls = [f"{'/'.join(map(str, k if isinstance(k, tuple) else (k,)))} from {at(g[axis].min())}"
             for k, g in failed.groupby(by)]
    return "Out of device memory: " + "; ".join(walls) + "."


def describe(name_a: str, a, name_b: str, b, what: str) -> str:
    """A's repeats against B's (a, b: their values) as a ratio of geometric means with the timing rule's interval,
    described, never ranked nor called alike: the page's one tested statement is its lead (kvlib.report.pages.TIMING),
    and a claim of equivalence would be a second. Where the interval holds 1, the two are "not distinguishable at n
    repeats", which spends no error rate."""
    c = stats.compare_timings(a, b)
    head = f"{name_a} / {name_b} {what}: {c.ratio:.2f}x"
    if not c.judged:
        return f"{head} (too few repeats for an interval: {c.n_a} and {c.n_b})"
    words = f"{head} (interval {c.low:.2f}-{c.high:.2f}x"
    if c.verdict == stats.NOT_DISTINGUISHABLE:
        words += f"; not distinguishable at {min(c.n_a, c.n_b)} repeats"
    return words + ")"


def repeats_of(df: pd.DataFrame) -> int | None:
    """The repeats a side the page's timings have (the fewest of any point), for the rule's real error rate."""
    keys = [c for c in ("policy", "prefill", "prompt_tokens", "batch_size", "output_tokens") if c in df]
    done = df[~df["oom"].astype(bool)] if "oom" in df else df
    return int(done.groupby(keys).size().min()) if keys and not done.empty else None


def timing_rule_line(df: pd.DataFrame) -> str:
    """How the page's timings are read, said once: the rule with its real size and coverage at the page's repeats."""
    rule = stats.timing_rule(repeats=repeats_of(df), paired="repeat" in df)
    return (f"How timings are read: {rule}; every ratio on this page is described "
            f"with that interval, none is a tested ranking or likeness (the page's one tested statement is its lead; "
            f"the findings' claims are on the findings page); only rows measured on one kind of machine (CPU model "
            f"and GPU) are compared.")


def per_machine(lines_of, df: pd.DataFrame) -> list[str]:
    """lines_of(df) for each kind of machine the rows were measured on: a timing on one machine says nothing about
    another, so a frame that mixes them is read one kind at a time, and says so."""
    kinds = machine_kind(df)
    if kinds.nunique() <= 1:
        return lines_of(df)
    counts = kinds.value_counts().sort_index()
    out = [f"Ours: these rows were measured on {len(counts)} kinds of machine ("
           + "; ".join(f"{kind}: {n} rows" for kind, n in counts.items())
           + "): timings are compared only between rows of one kind, each kind read on its own below."]
    for kind, g in df.groupby(kinds, sort=True):
        out += [line.replace("Ours: ", f"Ours, on {kind}: ", 1) for line in lines_of(g)]
    return out


def disturbed_note(df: pd.DataFrame) -> list[str]:
    if "disturbed" not in df or not df["disturbed"].fillna(False).any():
        return []
    d = df[df["disturbed"].fillna(False).astype(bool)]
    note = (f"Ours: {len(d)} measurement(s) ran while other processes or the hypervisor (steal time) took more than "
            f"10 % of the CPU, twice in a row ({', '.join(sorted(d['policy'].unique()))}); they are kept and flagged "
            f"`disturbed` in the results.")
    return [note]


def page_lines(claim: str, lines_of, df: pd.DataFrame) -> list[str]:
    """A timing chapter's sentences: the paper's claim, ours per kind of machine (lines_of), how its timings are read,
    and the runs disturbed while they were timed."""
    return [f"Paper: {claim}"] + per_machine(lines_of, df) + [timing_rule_line(df)] + disturbed_note(df)
