"""The sentences of the accuracy and retention chapters: each task's full-cache score and, where the full cache
passes the validity gate, each policy's paired change from it with its interval, adjusted across the page."""

from __future__ import annotations

import math

import pandas as pd

from kvlib.report import paper, stats
from kvlib.report.accuracy_findings import retention_claims
from kvlib.report.drop_words import change
from kvlib.report.gate import GATE, accuracy_gate, beyond_model, passing, retention_gate
from kvlib.report.pages import ACCURACY
from kvlib.report.paper_accuracy import described, own_rows, paper_rows
from kvlib.report.paper_accuracy_beside import accuracy_claims
from kvlib.report.tables import (
    accuracy_item,
    accuracy_table,
    budgeted,
    retention_design,
    ruler_rows,
    ruler_table,
    scored_rows,
    wilson,
)


def role(df: pd.DataFrame, policy: str) -> str:
    """" (exploratory)" for a policy the profile ran on fewer items (kvlib.study.profile: `exploratory`)."""
    if "role" not in df:
        return ""
    return " (exploratory)" if (df.loc[df["policy"] == policy, "role"] == "exploratory").any() else ""


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


H2O_VS_INFINIGEN = "h2o vs infinigen"


def _who_loses_more(drop: stats.Drop) -> str:
    """H2O against InfiniGen on the same items (the paper: H2O loses more)."""
    words = {stats.LOWER: "H2O loses more than InfiniGen", stats.HIGHER: "InfiniGen loses more than H2O",
             stats.EQUIVALENT: f"H2O and InfiniGen are equivalent within +-{stats.EQUIVALENCE_MARGIN * 100:.0f} pp",
             stats.INCONCLUSIVE: f"H2O and InfiniGen are not distinguishable on these {drop.clusters} units"}
    return f"{words[drop.verdict]} (H2O's change from InfiniGen {change(drop)}; paper: H2O loses more)"


def paper_tasks(df: pd.DataFrame, gate: float = GATE) -> list[str]:
    """Finding 4's drops on the paper's six tasks (kvlib.report.paper_accuracy), described: what they rest on, then
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


def accuracy(df: pd.DataFrame, gate: float = GATE) -> list[str]:
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


def per_protocol(lines_of, df: pd.DataFrame) -> list[str]:
    """lines_of(df) for each protocol the rows ran under (kvlib.evaluation.generation): a score as deployed and a
    strict one are different measurements, never pooled."""
    if "protocol" not in df or df["protocol"].nunique() <= 1:
        return lines_of(df)
    out = []
    for protocol, g in df.groupby("protocol", sort=True):
        out += [line.replace("Ours: ", f"Ours ({protocol} protocol): ", 1) for line in lines_of(g)]
    return out


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


def retention(df: pd.DataFrame, gate: float = GATE) -> list[str]:
    """Each policy's share of facts retained per protocol, described, over the buckets the full cache passes (the
    validity gate; the others said to be beyond the model); then the page's tested statements, finding 5's claims,
    the same objects the findings page reads (kvlib.report.accuracy_findings.retention_claims)."""
    out = [f"Paper: {paper.RETENTION}"]
    if df.empty or "full" not in set(df["policy"]):
        return out + ["Ours: no full-cache run to compare with."]
    gated = retention_gate(df, gate)
    valid = passing(gated, "bucket")
    out += beyond_model(gated, gate, "retention bucket")
    kept = df[df["bucket"].isin(valid)]
    if kept.empty:
        return out + ["Ours: no bucket passes the validity gate: no verdict on retention."]
    claims = retention_claims(df, gate)
    tested = ([f"Ours, finding 5 (as deployed): {line}." for line in claims.context]
              + [f"Ours, finding 5 (as deployed): {c.line()}." for c in claims.claims]
              + [f"Ours, finding 5: {name}: untested." for name in claims.untested])
    return out + per_protocol(_retention, kept) + tested


def _retention(df: pd.DataFrame) -> list[str]:
    """The shares retained, described (a verdict is finding 5's, below)."""
    item, cluster, stratum = retention_design(df)
    d = budgeted(df).assign(correct=df["correct"].astype(float))
    full = d[d["policy"] == "full"]
    level = 1 - stats.ALPHA  # a description of the full cache's score, not a tested statement: unadjusted
    if set(item) <= set(df.columns):
        units = full[cluster].drop_duplicates().shape[0]
        low, high = stats.mean_interval(full, "correct", cluster, stratum, level=level)
        # the methods' floor (stats.resolution): a bootstrap of conversations all answered alike has no spread
        floor, mean = stats.resolution(units, level), full["correct"].mean()
        low, high = max(min(low, mean - floor), 0.0), min(max(high, mean + floor), 1.0)
        how = (f"in {units} conversations; {level * 100:g} % interval {low:.0%}-{high:.0%}, conversations resampled "
               f"within buckets, no narrower than {units} conversations resolve")
    else:
        low, high = wilson(full["correct"].sum(), len(full))
        how = f"{level * 100:g} % interval {low:.0%}-{high:.0%}, Wilson"
    out = [f"Ours: {len(full)} questions per policy; the full cache answers {full['correct'].mean():.0%} ({how})."]
    for (policy, budget), g in d[d["policy"] != "full"].groupby(["policy", "budget"]):
        used = (f"; attending {g['kv_share_attended'].median():.0%} of the KV"
                if "kv_share_attended" in g and g["kv_share_attended"].notna().any() else "")
        out.append(f"Ours: {policy}{role(df, policy)} at budget {budget:g} answers {g['correct'].mean():.0%}{used}.")
    by_bucket = df.groupby(["bucket", "policy"])["correct"].mean().unstack()
    for bucket, row in by_bucket.iterrows():
        out.append(f"Ours: bucket {bucket}: " + ", ".join(f"{p} {v:.0%}" for p, v in row.items()) + ".")
    return out
