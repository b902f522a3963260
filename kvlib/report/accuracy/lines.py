"""The accuracy chapter's lead and sentences: the paper's six tasks as finding 4 reads them (described; the verdicts are
the findings page's), then the book's own tasks: each task's full-cache score and, where the full cache passes the
validity gate, each policy's paired change from it with its interval, adjusted across the page; RULER's likewise."""

from __future__ import annotations

import math

import pandas as pd

from kvlib.report import paper, stats
from kvlib.report.accuracy import frontier, paper_sizes
from kvlib.report.accuracy.paper_beside import accuracy_claims
from kvlib.report.accuracy.paper_tasks import described, own_rows, paper_rows
from kvlib.report.accuracy.tables import accuracy_table, ruler_table
from kvlib.report.drop_words import change, per_protocol, role
from kvlib.report.gate import GATE, accuracy_gate, beyond_model, passing
from kvlib.report.measures import accuracy_item, ruler_rows, scored_rows
from kvlib.report.opening import NOTHING
from kvlib.report.pages import ACCURACY

H2O_VS_INFINIGEN = "h2o vs infinigen"


def lead(df: pd.DataFrame, gate: float = GATE, sizes=None) -> str:
    """`sizes`: the rows the size reading reads (kvlib.study.reference.rows_for: another published book's where these
    hold one model), so that the lead carries toward 8B what the chapter's size section shows; None: these rows."""
    if df.empty:
        return NOTHING
    out = [_paper_tasks_lead(df, gate, sizes)] if not paper_rows(df, None).empty else []
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


def _drops_text(drops: dict, who: tuple[str, ...]) -> str:
    return "; ".join(f"{policy} at {budget:g} {change(d)}"
                     for (_, budget, policy), d in sorted(drops.items(), key=lambda kv: (kv[0][1], kv[0][2]))
                     if policy in who)


def _paper_tasks_lead(df: pd.DataFrame, gate: float, sizes) -> str:
    """Finding 4's task-average drops on the paper's six tasks, described (its verdicts are the findings page's)."""
    claims = accuracy_claims(df, gate)
    if claims.unanswered:
        return f"The paper's six tasks give no reading here: {claims.unanswered[1]}."
    drops = [f"{c.name}: {described(c.drop)}" for c in claims.claims if "average" in c.name or "near" in c.name]
    return ("On the paper's six tasks (the official harnesses' one-pass protocol, averaged over the tasks the full "
            "cache passes; the verdicts are the findings page's): " + "; ".join(drops) + ". " + _carried(df, gate, sizes))


def _carried(df: pd.DataFrame, gate: float, sizes) -> str:
    if sizes is None or sizes.book is None:
        return paper_sizes.carry(df, gate)
    return (f"From the {sizes.book} reference book's rows, as the size section below reads them (this profile's do not "
            f"hold two models of known size): {paper_sizes.carry(sizes.rows, sizes.gate)}")


def accuracy_rule(drops: dict, section: str, resampled: str = "items resampled") -> list[str]:
    """The rule behind a section's accuracy verdicts, said once per section (the page's error rate is said at its
    top), and the fallback where rows carried no item ids."""
    if not drops:
        return []
    level = next(iter(drops.values())).level
    rule = (f"How differences are judged: each change is read on the same items (paired) with a bootstrap interval "
            f"({resampled}); the {len(drops)} intervals of {section} spend its {ACCURACY.share(section):.2%} of the "
            f"page's error rate (Bonferroni: each at {level:.2%}); 'equivalent' when the interval lies within "
            f"+-{stats.EQUIVALENCE_MARGIN * 100:.0f} pp, 'lower'/'higher' when it excludes 0, else 'inconclusive'.")
    unpaired = sum(not d.paired for d in drops.values())
    note = (f"Ours: {unpaired} of these {len(drops)} comparisons could not pair their items: the rows carry no item "
            f"ids (results from before they were recorded), so each side is resampled on its own, a wider interval.")
    return [rule] + ([note] if unpaired else [])


def family(pairs: dict, value: str, item: list[str], cluster: list[str] | None = None,
            stratum: str | None = None, alpha: float = stats.ALPHA) -> dict:
    """The paired drops of every (reference rows, policy rows) pair, their intervals spending `alpha` together
    (a page's section: kvlib.report.pages)."""
    level = stats.family_level(len(pairs), alpha)
    return {key: stats.paired_drop(ref, other, value, item, cluster, stratum, level=level)
            for key, (ref, other) in pairs.items()}


def pairs_against_full(rows: pd.DataFrame, key) -> dict:
    """(full's rows, the policy's rows) per policy and budget, and (InfiniGen's, H2O's) per budget where both ran: the
    paper's two comparisons."""
    full = rows[rows["policy"] == "full"]
    pairs = {}
    if full.empty:
        return pairs
    for (policy, budget), g in rows[rows["policy"] != "full"].groupby(["policy", "budget"]):
        pairs[(*key, budget, policy)] = (full, g)
    for budget, b in rows.groupby("budget"):
        if {"h2o", "infinigen"} <= set(b["policy"]):
            pairs[(*key, budget, H2O_VS_INFINIGEN)] = (b[b["policy"] == "infinigen"], b[b["policy"] == "h2o"])
    return pairs


def _who_loses_more(drop: stats.Drop) -> str:
    """H2O against InfiniGen on the same items (the paper: H2O loses more)."""
    words = {stats.LOWER: "H2O loses more than InfiniGen", stats.HIGHER: "InfiniGen loses more than H2O",
             stats.EQUIVALENT: f"H2O and InfiniGen are equivalent within +-{stats.EQUIVALENCE_MARGIN * 100:.0f} pp",
             stats.INCONCLUSIVE: f"H2O and InfiniGen are not distinguishable on these {drop.clusters} units"}
    return f"{words[drop.verdict]} (H2O's change from InfiniGen {change(drop)}; paper: H2O loses more)"


def paper_tasks(df: pd.DataFrame, gate: float = GATE) -> list[str]:
    """Finding 4's drops on the paper's six tasks (kvlib.report.accuracy.paper_tasks), described: what they rest on, then
    each claim's drop and interval without a verdict word (the verdicts are the findings page's, in its family);
    nothing where the rows hold none of those tasks."""
    if paper_rows(df, None).empty:
        return []
    claims = accuracy_claims(df, gate)
    if claims.unanswered:
        return [f"The paper's six tasks: no reading ({claims.unanswered[1]})."]
    return [f"The paper's six tasks: {line}" for line in claims.context] + [
        f"The paper's six tasks, {c.name}: {described(c.drop)} ({c.drop.clusters} {c.units}; the verdict is the "
        f"findings page's)" for c in claims.claims]


def lines(df: pd.DataFrame, gate: float = GATE) -> list[str]:
    """The paper's six tasks as finding 4 reads them, then the book's own tasks: each task's full-cache score, and,
    where the full cache passes the validity gate (kvlib.report.gate), each policy's paired change from it; a task the
    full cache fails is said to be beyond the model, with no verdict."""
    out = [f"Paper: {paper.ACCURACY}", *paper_tasks(df, gate)]
    df = own_rows(df)
    table = accuracy_table(df)
    gated = accuracy_gate(df, gate)
    gated = gated[gated["length"].isna()]
    valid = passing(gated, "task")
    drops = multiple_choice_drops(df, gate)
    for task, t in table.groupby("task"):
        full = t[t["policy"] == "full"]
        if full.empty:
            continue
        base, metric = full.iloc[0], t["metric"].iloc[0]
        unit = (lambda x: f"{x:.1%}") if metric == "accuracy" else (lambda x: f"{x:.2f}")
        out.append(f"Ours: {task} ({t['items'].iloc[0]} items), full cache {metric} {unit(base['score'])} "
                   f"(95 % interval {unit(base['low'])}-{unit(base['high'])}).")
        if metric == "accuracy" and task not in valid:
            out += beyond_model(gated[gated["task"] == task], gate)
            continue
        for budget, b in t[t["policy"] != "full"].groupby("budget"):
            parts = []
            for _, row in b.iterrows():
                delta = (change(drops[(task, budget, row["policy"])]) if metric == "accuracy"
                         else f"{row['score'] / base['score'] - 1:+.1%}")
                used = (f"; attended {row['kv_share_attended']:.0%} of the KV"
                        if not math.isnan(row["kv_share_attended"]) else "")
                parts.append(f"{row['policy']}{role(df, row['policy'])} {unit(row['score'])} ({delta}{used})")
            out.append(f"Ours: {task} at budget {budget:g}: " + ", ".join(parts) + ".")
            if (task, budget, H2O_VS_INFINIGEN) in drops:
                out.append(f"Ours: {task} at budget {budget:g}: "
                           f"{_who_loses_more(drops[(task, budget, H2O_VS_INFINIGEN)])}.")
    return out + accuracy_rule(drops, "multiple choice") + ruler(df, gate)


def multiple_choice_drops(df: pd.DataFrame, gate: float = GATE) -> dict:
    """(task, budget, policy) -> each policy's paired drop from the full cache (and H2O's from InfiniGen) on every
    multiple-choice task of the book's own the full cache passes (the paper's six are finding 4's: paper_tasks), read by
    the page's lead and its body."""
    df = own_rows(df)
    rows = scored_rows(df)
    table = accuracy_table(df)
    gated = accuracy_gate(df, gate)
    valid = passing(gated[gated["length"].isna()], "task")
    pairs = {}
    for task in table.loc[table["metric"] == "accuracy", "task"].unique():
        if task in valid:
            pairs.update(pairs_against_full(rows[rows["task"] == task], (task,)))
    return family(pairs, "correct", accuracy_item(rows), alpha=ACCURACY.share("multiple choice"))


def ruler(df: pd.DataFrame, gate: float = GATE) -> list[str]:
    """RULER read against the paper's accuracy finding, per protocol where rows ran under several: the subtasks and
    lengths the full cache passes (the validity gate; the others said to be beyond the model), the mean over those
    subtasks per length, each policy's change from the full cache at each budget on the same items (resampled within
    each subtask), and whether H2O loses more than InfiniGen."""
    if "ruler_score" not in df or df["ruler_score"].isna().all():
        return []
    d = df[df["ruler_score"].notna()]
    gated = accuracy_gate(d, gate)
    gated = gated[gated["length"].notna()]
    valid = {(t, int(n)) for t, n, ok in zip(gated["task"], gated["length"], gated["passes"]) if ok}
    kept = d[[(t, int(n)) in valid for t, n in zip(d["task"], d["length"])]]
    protocols = kept["protocol"].nunique() if "protocol" in kept and not kept.empty else 1
    share = ACCURACY.share("RULER") / max(protocols, 1)  # each protocol's intervals a part of the section's share
    return beyond_model(gated, gate, "RULER subtask") + per_protocol(lambda g: _ruler(g, share), kept)


def _ruler(df: pd.DataFrame, alpha: float) -> list[str]:
    table = ruler_table(df)
    if table.empty:
        return []
    rows = ruler_rows(df)
    pairs = {}
    for length, at in rows.groupby("length"):
        pairs.update(pairs_against_full(at, (length,)))
    drops = family(pairs, "ruler_score", accuracy_item(rows), stratum="task", alpha=alpha)
    out = []
    means = table[table["task"] == "mean"]
    for length, t in means.groupby("length"):
        full = t[t["policy"] == "full"]
        if full.empty:
            continue
        base = full.iloc[0]
        tasks = sorted(table.loc[(table["length"] == length) & (table["task"] != "mean"), "task"].unique())
        out.append(f"Ours: RULER at {length:,} tokens ({', '.join(tasks)}; {base['items']} items), full cache "
                   f"{base['score']:.1%} (95 % interval {base['low']:.1%}-{base['high']:.1%}).")
        for budget, b in t[t["policy"] != "full"].groupby("budget"):
            parts = [f"{row['policy']}{role(df, row['policy'])} {row['score']:.1%} "
                     f"({change(drops[(length, budget, row['policy'])])}"
                     + (f"; attended {row['kv_share_attended']:.0%} of the KV"
                        if not math.isnan(row["kv_share_attended"]) else "") + ")" for _, row in b.iterrows()]
            out.append(f"Ours: RULER at {length:,} tokens, budget {budget:g}: " + ", ".join(parts) + ".")
            if (length, budget, H2O_VS_INFINIGEN) in drops:
                out.append(f"Ours: RULER at {length:,} tokens, budget {budget:g}: "
                           f"{_who_loses_more(drops[(length, budget, H2O_VS_INFINIGEN)])}.")
    return out + [line.replace("each change", "each RULER change", 1)
                  for line in accuracy_rule(drops, "RULER", "items resampled within each subtask")]
