"""The accuracy-memory frontier (issue 45, the paper's future work): does an adaptive hybrid policy lose less than the
uniform policies at equal KV bytes?

Every accuracy row records what its policy held on the device while it answered (KVUsage: device KV bytes per token
seen, `kv_share_held` as a share of the full cache's), so each (policy, budget) is a point of score change from the full
cache against bytes held, measured rather than read off a setting. The bytes are what the device holds for the rows'
cache, for every runner alike (the ledger's `kv`): for Ada-KV and PyramidKV the slots of a row's widest head or layer
in every head and layer, since a policy that holds its entries in padded slots pays for the padding
(kvlib.policies.scored_eviction); a block pool's free blocks are no one's. The hybrids (`HYBRIDS`: DuoAttention's retrieval and
streaming heads, Ada-KV's and PyramidKV's budgets moved across heads and layers) are read against the uniform
policies (`UNIFORM`: the same count of entries in every head) at the same budget, which the budget rules make about
the same count of entries (kvlib.policies.base.BudgetedPolicy.tokens_allowed; duo's mapping in kvlib.policies.duo),
not always the same bytes. A hybrid is
compared with the uniform policy that lost least there (by its point estimate) among those whose measured bytes are
within a factor EQUAL_BYTES of its own (all of them where none is, and the sentence says so), item by item
(kvlib.report.stats.paired_drop), the section's intervals spending its share of the page's error rate
(kvlib.report.pages); the bytes both held are said beside the verdict.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from kvlib.policies import REGISTRY
from kvlib.report import stats
from kvlib.report.drop_words import change, role
from kvlib.report.figure_style import policy_colours, set_style
from kvlib.report.gate import GATE, passing_units
from kvlib.report.measures import accuracy_item
from kvlib.report.pages import ACCURACY
from kvlib.report.provenance import suptitle

HYBRIDS = ("duo", "adakv", "pyramidkv")
UNIFORM = ("h2o", "snapkv", "streaming")
EQUAL_BYTES = 1.25  # two policies whose bytes held per token are within this factor are compared at equal bytes


def units(df: pd.DataFrame, gate: float = GATE) -> dict[str, tuple[pd.DataFrame, str, str | None]]:
    """Each scored unit whose full cache passes the validity gate (kvlib.report.gate.passing_units), where the rows
    measured the KV each policy held."""
    return {} if df.empty or "kv_share_held" not in df else passing_units(df, gate)


def points(df: pd.DataFrame, gate: float = GATE) -> pd.DataFrame:
    """One row per unit, policy (the full cache aside: it is the origin) and budget: the KV share it held (median over
    its items' rows: they share it) and its score change from the full cache on the same items, 95 % interval (each
    on its own: what the figure draws); `shared_prompt` where its answers forked off one prompt (multiple choice)
    and its forks share that prompt's blocks (KVPolicy.shares_forks): its bytes per token are not a copying policy's."""
    rows = []
    for unit, (d, value, stratum) in units(df, gate).items():
        full = d[d["policy"] == "full"]
        if full.empty:
            continue
        item = accuracy_item(d)
        for (policy, budget), g in d[d["policy"] != "full"].groupby(["policy", "budget"]):
            drop = stats.paired_drop(full, g, value, item, stratum=stratum)
            rows.append({"unit": unit, "policy": policy, "budget": budget,
                         "kind": "hybrid" if policy in HYBRIDS else "uniform" if policy in UNIFORM else "other",
                         "kv_share_held": g["kv_share_held"].median(), "change_pp": -drop.drop * 100,
                         "low_pp": -drop.high * 100, "high_pp": -drop.low * 100, "items": drop.items,
                         "shared_prompt": _shared_prompt(g, value)})
    return pd.DataFrame(rows, columns=["unit", "policy", "budget", "kind", "kv_share_held", "change_pp", "low_pp",
                                       "high_pp", "items", "shared_prompt"])


def _shared_prompt(rows: pd.DataFrame, value: str) -> bool:
    """A multiple-choice unit's rows (scored `correct`: the choices fork off one prompt) of a runner whose forks share
    their blocks."""
    cls = REGISTRY.get(rows["runner"].iloc[0]) if "runner" in rows else None
    return bool(value == "correct" and cls and cls.shares_forks)


def comparisons(df: pd.DataFrame, gate: float = GATE) -> dict:
    """(unit, budget, hybrid, uniform) -> the hybrid's drop from the uniform policy that lost least at that budget
    among those that held equal bytes (within EQUAL_BYTES; where none did, among all), paired, the page's intervals
    adjusted together."""
    pairs = {}
    for unit, (d, value, stratum) in units(df, gate).items():
        full = d[d["policy"] == "full"]
        for budget, b in d[d["policy"] != "full"].groupby("budget"):
            uniform = [p for p in UNIFORM if p in set(b["policy"])]
            if full.empty or not uniform:
                continue
            item = accuracy_item(b)
            lost = {p: stats.paired_drop(full, b[b["policy"] == p], value, item, stratum=stratum).drop
                    for p in uniform}
            for hybrid in (p for p in HYBRIDS if p in set(b["policy"])):
                equal = [p for p in uniform if _equal_bytes(_held(b, hybrid, budget), _held(b, p, budget))]
                best = min(equal or uniform, key=lost.get)
                pairs[(unit, budget, hybrid, best)] = (b[b["policy"] == best], b[b["policy"] == hybrid], value,
                                                       item, stratum)
    level = stats.family_level(len(pairs), ACCURACY.share("the frontier"))
    return {key: stats.paired_drop(ref, other, value, item, stratum=stratum, level=level)
            for key, (ref, other, value, item, stratum) in pairs.items()}


def _held(d: pd.DataFrame, policy: str, budget: float) -> float:
    return d.loc[(d["policy"] == policy) & (d["budget"] == budget), "kv_share_held"].median()


def _equal_bytes(a: float, b: float) -> bool:
    return bool(a > 0 and b > 0 and 1 / EQUAL_BYTES <= a / b <= EQUAL_BYTES)


def _against(drop: stats.Drop, hybrid: str, uniform: str) -> str:
    words = {stats.HIGHER: f"{hybrid} loses less than {uniform}", stats.LOWER: f"{hybrid} loses more than {uniform}",
             stats.EQUIVALENT: f"{hybrid} and {uniform} are equivalent within +-{stats.EQUIVALENCE_MARGIN * 100:.0f} pp",
             stats.INCONCLUSIVE: f"{hybrid} and {uniform} are not distinguishable on these {drop.clusters} "
                                 f"item{'s' if drop.clusters != 1 else ''}"}
    return words[drop.verdict]


def lines(df: pd.DataFrame, gate: float = GATE) -> list[str]:
    """The frontier's verdicts, one per hybrid, unit and budget, each with the bytes both held; then the tally."""
    drops = comparisons(df, gate)
    if not drops:
        return ["Ours: no frontier verdict: no hybrid and uniform policy answered the same items at one budget on a "
                + "task the full cache passes."]
    frames = units(df, gate)
    out = []
    for (unit, budget, hybrid, uniform), drop in drops.items():
        d = frames[unit][0]
        held_h, held_u = _held(d, hybrid, budget), _held(d, uniform, budget)
        equal = "" if _equal_bytes(held_h, held_u) else " (not equal bytes: no uniform policy held as much there)"
        out.append(f"Ours: {unit} at budget {budget:g}: {_against(drop, hybrid, uniform)} ({hybrid}{role(df, hybrid)}'s "
                   f"change from {uniform}, the uniform policy that lost least there at equal bytes: {change(drop)}), "
                   f"holding {held_h:.1%} of the full cache's KV bytes per token against {held_u:.1%}{equal}.")
    out.append(f"Ours: {tally(drops)}.")
    out += head_stability(df)
    out += shared_prompt_note(df, gate)
    level = next(iter(drops.values())).level
    out.append(f"How: each comparison pairs the two policies' answers item by item (a bootstrap interval, items "
               f"resampled, RULER's within each subtask); the {len(drops)} intervals spend the frontier's "
               f"{ACCURACY.share('the frontier'):.2%} of the page's error rate (Bonferroni: each at {level:.2%}); "
               f"'loses less' or 'more' needs the interval to exclude 0 and an exact sign test to agree, 'equivalent' an interval within +-{stats.EQUIVALENCE_MARGIN * 100:.0f} "
               f"pp. The uniform policy compared is the one that lost least at that budget, chosen after the fact: "
               f"the comparison favours it.")
    return out


def tally(drops: dict) -> str:
    """How the comparisons came out, in words: 'of 6 hybrid-against-uniform comparisons, the hybrid loses less in 1,
    ...'."""
    counts = pd.Series([d.verdict for d in drops.values()]).value_counts()
    said = {stats.HIGHER: "loses less", stats.LOWER: "loses more", stats.EQUIVALENT: "is equivalent",
            stats.INCONCLUSIVE: "cannot be told apart"}
    return (f"of {len(drops)} hybrid-against-uniform comparisons, the hybrid "
            + ", ".join(f"{said[v]} in {n}" for v, n in counts.items()))


def shared_prompt_note(df: pd.DataFrame, gate: float = GATE) -> list[str]:
    """Which points' bytes count a forked prompt once (their blocks shared among the choices): not comparable with a
    policy that copies the prompt into every choice, and never in a verdict (no hybrid or uniform policy shares)."""
    shared: dict[str, list[str]] = {}  # read off the units' rows: no interval needed for this
    for unit, (d, value, _) in units(df, gate).items():
        for policy, g in d[d["policy"] != "full"].groupby("policy"):
            if _shared_prompt(g, value):
                shared.setdefault(policy, []).append(unit)
    if not shared:
        return []
    where = "; ".join(f"{policy} on {', '.join(sorted(on))}" for policy, on in sorted(shared.items()))
    return [(f"Mind: {where}: the answer choices fork off one prompt and this policy's forks share its blocks (copied "
             f"on write), so its bytes per token count the prompt once for all choices; every other policy here copies "
             f"the prompt's kept entries into each. Its point is drawn with a cross and is not a bytes-for-bytes "
             f"comparison.")]


def head_stability(df: pd.DataFrame) -> list[str]:
    """DuoAttention's heads as its rows recorded them (kvlib.policies.duo_heads.stability): how many retrieval heads
    its budget came to, and the share of them it would also choose calibrated on another passage."""
    if "retrieval_heads_overlap" not in df:
        return []
    d = df.dropna(subset=["retrieval_heads_overlap"])
    parts = [f"at {r:.2f} ({int(g['retrieval_heads_chosen'].iloc[0])} heads) {g['retrieval_heads_overlap'].iloc[0]:.0%}"
             for r, g in d.groupby("retrieval_ratio_used")]
    if not parts:
        return []
    return ["Ours: duo's retrieval heads chosen on the CPython docs' first passage and on a passage from their middle "
            "have in common, by the ratio its budgets came to: " + "; ".join(parts) + "."]


def plot(df: pd.DataFrame, gate: float = GATE):
    """Score change from the full cache (pp, 95 % paired interval) against the KV bytes per token held on the device
    (a share of the full cache's), one panel per unit: every policy a line through its budgets, the hybrids filled
    and solid, the uniform policies hollow and dashed, the others dotted; the full cache at (1, 0)."""
    table = points(df, gate)
    if table.empty:
        return None
    set_style()
    names = list(table["unit"].unique())
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 6.5), squeeze=False)
    palette = policy_colours(table["policy"])
    styles = {"hybrid": ("-", "full"), "uniform": ("--", "none"), "other": (":", "full")}
    for ax, unit in zip(axes.flat, names):
        t = table[table["unit"] == unit]
        for policy, g in t.groupby("policy"):
            g = g.sort_values("kv_share_held")
            line, fill = styles[g["kind"].iloc[0]]
            shared = bool(g["shared_prompt"].any())
            ax.errorbar(g["kv_share_held"], g["change_pp"],
                        yerr=[(g["change_pp"] - g["low_pp"]).clip(lower=0), (g["high_pp"] - g["change_pp"]).clip(lower=0)],
                        marker="X" if shared else "o", ls=line, fillstyle=fill, capsize=3, color=palette[policy],
                        label=policy + (" (forks share the prompt)" if shared else ""))
        ax.axhline(0, color="black", lw=1)
        ax.plot([1.0], [0.0], marker="*", ms=12, color="black", ls="none", label="full")
        ax.set(xlabel="KV bytes per token held on the device (share of the full cache's)",
               ylabel="score change from the full cache (pp)", title=unit, xlim=(0, 1.05))
    key = {}  # every panel's policies, once each (a label can differ by panel: a shared prompt is said where it is)
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            key.setdefault(label, handle)
    fig.legend(key.values(), key.keys(), loc="lower center", ncol=4, fontsize="small",
               title="hybrid: solid, filled; uniform: dashed, hollow; other: dotted")
    suptitle(fig, df)
    fig.tight_layout(rect=(0, 0.06 + 0.045 * -(-len(key) // 4), 1, 1))
    return fig

