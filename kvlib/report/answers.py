"""Each chapter's opening: two or three sentences that answer the chapter's question from its results, before any
figure or table. Every figure in them is read from the frame; a lead is a description (the highest geometric mean,
the ratio to the next with the timing rule's interval), never a ranking claim (those are the findings' family,
kvlib.report.verdicts); its last sentence says which model(s) and machine the rows come from. An empty frame answers
that nothing was measured."""

from __future__ import annotations

import pandas as pd

from kvlib.report import frontier, paper_accuracy_sizes, stats
from kvlib.report.accuracy_findings import deployed_rows, retention_claims
from kvlib.report.accuracy_lines import multiple_choice_drops
from kvlib.report.drop_words import change
from kvlib.report.gate import GATE
from kvlib.report.paper_accuracy import described, own_rows, paper_rows
from kvlib.report.paper_accuracy_beside import accuracy_claims
from kvlib.report.provenance import sentence
from kvlib.report.serving import sustained_rates
from kvlib.report.tables import decode_spread, geometric_mean, retention_design, scored_rows, ttft_spread

NOTHING = "Nothing was measured for this chapter in this profile."


def _lead(runs: dict[str, pd.DataFrame], value: str, higher: bool) -> tuple[str, str | None, stats.TimingComparison
                                                                             | None]:
    """The runner with the best geometric mean of `value`, the next, and the first against the next."""
    centres = {k: geometric_mean(g[value]) for k, g in runs.items()}
    ranked = sorted(centres, key=lambda k: centres[k], reverse=higher)
    if len(ranked) < 2:
        return ranked[0], None, None
    first, second = ranked[:2]
    return first, second, stats.compare_timings(stats.by_round(runs[first], value), stats.by_round(runs[second], value))


def _led(first: str, second: str | None, c: stats.TimingComparison | None, claim: str, figure: str,
         what: str) -> str:
    """The chapter's lead, worded by the comparison's verdict: `first` `claim` (e.g. "decodes fastest") only where the
    timing rule tells it from the runner-up; else the two are named as not told apart, at the repeats there were."""
    if c is None:
        return f"{first} ({figure})"
    interval = f"interval {c.low:.2f}-{c.high:.2f}x" if c.judged else "too few repeats for an interval"
    versus = f"{c.ratio:.2f}x {second}'s {what} ({interval})"
    if c.verdict in (stats.LARGER, stats.SMALLER):
        return f"{first} {claim} ({figure}), {versus}"
    told = "not distinguishable" if c.judged else f"not told apart at {min(c.n_a, c.n_b)} repeats"
    return f"{first} and {second} are {told}: {first} {figure}, {versus}"


def _oom(df: pd.DataFrame, by: list[str], axis: str, at) -> str:
    """Where each runner ran out of the device memory (at(x) names a grid value: "4,096 tokens", "batch 16")."""
    failed = df[df["oom"].astype(bool)]
    if failed.empty:
        return "Every runner completed every point of the grid within the device memory."
    walls = [f"{'/'.join(map(str, k if isinstance(k, tuple) else (k,)))} from {at(g[axis].min())}"
             for k, g in failed.groupby(by)]
    return "Out of device memory: " + "; ".join(walls) + "."


def _tokens(x) -> str:
    return f"{x:,} tokens"


def _batch(x) -> str:
    return f"batch {x}"


def ttft(df: pd.DataFrame) -> str:
    if df.empty:
        return NOTHING
    ok = df[~df["oom"].astype(bool)]
    out = []
    if not ok.empty:
        longest = ok["prompt_tokens"].max()
        runs = {f"{p}/{m}": g for (p, m), g in ok[ok["prompt_tokens"] == longest].groupby(["policy", "prefill"])}
        first, second, c = _lead(runs, "ttft_s", higher=False)
        lead = _led(first, second, c, "reaches the first token soonest",
                    f"{ttft_spread(runs[first]).centre:.2f} s by geometric mean", "time")
        out.append(f"At {longest:,} prompt tokens, {lead}.")
    out.append(_oom(df, ["policy", "prefill"], "prompt_tokens", _tokens))
    return " ".join(out)


def batch_scaling(df: pd.DataFrame) -> str:
    if df.empty:
        return NOTHING
    ok = df[~df["oom"].astype(bool)]
    if ok.empty:
        return _oom(df, ["policy"], "batch_size", _batch)
    big = ok[ok["batch_size"] == ok["batch_size"].max()]
    runs = dict(list(big.groupby("policy")))
    first, second, c = _lead(runs, "decode_tokens_per_s", higher=True)
    per_gib = {p: decode_spread(g).centre / (g["device_peak_bytes"].median() / 2**30) for p, g in runs.items()}
    lead = _led(first, second, c, "decodes fastest", f"{decode_spread(runs[first]).centre:.1f} tok/s by geometric mean",
                "throughput")
    per = ", ".join(f"{p} {v:.1f}" for p, v in sorted(per_gib.items()))  # by name: a description, not a ranking
    return (f"At batch {int(big['batch_size'].iloc[0])}, {lead}. Throughput per GiB of device memory (geometric mean "
            f"over the booked peak, tok/s per GiB): {per}. " + _oom(df, ["policy"], "batch_size", _batch))


def decode_length(df: pd.DataFrame) -> str:
    if df.empty:
        return NOTHING
    ok = df[~df["oom"].astype(bool)]
    longest, shortest = ok["output_tokens"].max(), ok["output_tokens"].min()
    runs = dict(list(ok[ok["output_tokens"] == longest].groupby("policy")))
    first, second, c = _lead(runs, "decode_tokens_per_s", higher=True)
    changes = []
    for _, g in ok.groupby("policy"):
        a, b = g[g["output_tokens"] == shortest], g[g["output_tokens"] == longest]
        if not a.empty and not b.empty:
            changes.append(geometric_mean(b["decode_tokens_per_s"]) / geometric_mean(a["decode_tokens_per_s"]) - 1)
    span = (f" From {shortest} to {longest} output tokens the runners' throughputs change by {min(changes):+.0%} to "
            f"{max(changes):+.0%} (geometric means)." if changes and longest != shortest else "")
    prompt = f" after a {int(ok['prompt_tokens'].iloc[0]):,}-token prompt" if "prompt_tokens" in ok else ""
    lead = _led(first, second, c, "decodes fastest", f"{decode_spread(runs[first]).centre:.1f} tok/s by geometric mean",
                "throughput")
    return f"At {longest} output tokens{prompt}, {lead}.{span}"


def serving(df: pd.DataFrame) -> str:
    if df.empty:
        return NOTHING
    rates = sustained_rates(df)
    ranked = sorted(rates.items(), key=lambda kv: -(kv[1].rate or 0))
    capacity = df["device_capacity_gb"].dropna().max() if "device_capacity_gb" in df else None
    where = f"in {capacity:g} GiB of device memory" if pd.notna(capacity) else "with no configured device capacity"
    chosen = ""
    if "rate_multiple" in df and df["rate_multiple"].notna().any():
        pairs = df.dropna(subset=["rate_multiple"]).groupby("rate_multiple")["request_rate"].first()
        chosen = (f"The rates are {', '.join(f'{m:g}x' for m in pairs.index)} this machine's service rate "
                  f"({df['service_rate'].dropna().iloc[0]:.2f} requests/s: paged serving the whole trace at once), "
                  f"that is {', '.join(f'{r:.2f}' for r in pairs)} requests/s. ")
    return (chosen + f"The highest request rate each runner sustains within the SLO {where}, measured rates only: "
            + "; ".join(f"{p} {s.text()}" for p, s in ranked) + ".")


def _drops_text(drops: dict, who: tuple[str, ...]) -> str:
    return "; ".join(f"{policy} at {budget:g} {change(d)}"
                     for (_, budget, policy), d in sorted(drops.items(), key=lambda kv: (kv[0][1], kv[0][2]))
                     if policy in who)


def accuracy(df: pd.DataFrame, gate: float = GATE) -> str:
    if df.empty:
        return NOTHING
    out = [_paper_tasks_lead(df, gate)] if not paper_rows(df, None).empty else []
    drops = multiple_choice_drops(df, gate)  # the objects the page's reading prints (the book's own tasks)
    tasks = sorted({task for task, _, _ in drops})
    if not tasks:
        none = "No multiple-choice task of the book's own passes the validity gate: the chapter shows its scores, no verdict."
        return " ".join([*out, none])
    rows = scored_rows(own_rows(df))
    for task in tasks:
        full = rows.loc[(rows["task"] == task) & (rows["policy"] == "full"), "correct"].astype(float)
        on_task = {key: d for key, d in drops.items() if key[0] == task}
        out.append(f"On the book's {task} (the full cache {full.mean():.1%} over {len(full)} items, kvlib's deployed "
                   f"protocol), the paper's two sparse methods change by: {_drops_text(on_task, ('h2o', 'infinigen'))} "
                   f"(paired).")
    hybrids = frontier.comparisons(own_rows(df), gate)
    if hybrids:
        out.append(f"Against the uniform policy that lost least at the same budget, {frontier.tally(hybrids)} (the "
                   f"frontier below).")
    return " ".join(out)


def _paper_tasks_lead(df: pd.DataFrame, gate: float) -> str:
    """Finding 4's task-average drops on the paper's six tasks, described (its verdicts are the findings page's)."""
    claims = accuracy_claims(df, gate)
    if claims.unanswered:
        return f"The paper's six tasks give no reading here: {claims.unanswered[1]}."
    drops = [f"{c.name}: {described(c.drop)}" for c in claims.claims if "average" in c.name or "near" in c.name]
    return ("On the paper's six tasks (the official harnesses' one-pass protocol, averaged over the tasks the full "
            "cache passes; the verdicts are the findings page's): " + "; ".join(drops) + ". "
            + paper_accuracy_sizes.carry(df, gate))


def retention(df: pd.DataFrame, gate: float = GATE) -> str:
    if df.empty or "full" not in set(df["policy"]):
        return NOTHING
    claims = retention_claims(df, gate)  # finding 5's, as the findings page reads them
    if claims.unanswered:
        return f"No verdict on retention: {claims.unanswered[1]}."
    rows = deployed_rows(df, gate)
    full = rows[rows["policy"] == "full"]
    _, cluster, _ = retention_design(full)
    conversations = full[cluster].drop_duplicates().shape[0] if set(cluster) <= set(full.columns) else len(full)
    return (f"As deployed, over {conversations} conversations, the full cache recalls the early fact "
            f"{full['correct'].mean():.0%} of the time; "
            + "; ".join(c.line() for c in claims.claims) + " (finding 5's claims, conversations resampled within "
            "buckets).")


def opening(lead: str, df: pd.DataFrame, error_rate: str) -> str:
    """A chapter's opening sentences, as Markdown: its lead (one of the functions above, each experiment's declared
    `lead`: kvlib.study.experiment), the sentence naming the model(s) and machine its rows come from
    (kvlib.report.provenance, as its figures' titles do), then its page's error rate (kvlib.report.pages)."""
    if lead == NOTHING:
        return f"**In short.** {lead}"
    where = sentence(df)
    return f"**In short.** {lead}" + (f" {where}" if where else "") + f"\n\n{error_rate}"
