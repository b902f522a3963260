"""The verdict table that leads the book: each of the paper's five findings, confirmed, refuted or inconclusive
from every experiment's rows. 1-3 from the systems experiments (OOM boundaries; finding 2 as a declared family of
claims settled by Holm; booked host memory), 4 and 5 from the paired drops against the full cache where it passes the
validity gate."""

from __future__ import annotations

import pandas as pd

from kvlib.report import stats
from kvlib.report.accuracy_findings import Claims, accuracy_claims, retention_claims
from kvlib.report.gate import GATE
from kvlib.report.pages import FINDINGS as FINDINGS_FAMILY
from kvlib.report.tables import outside_label

CONFIRMED, REFUTED, INCONCLUSIVE = stats.CONFIRMED, stats.REFUTED, stats.INCONCLUSIVE
NOT_TESTABLE = "not testable on this machine"
# a finding some of whose claims this machine lacks the mechanism for: the rest confirmed
CONFIRMED_WHERE_TESTABLE = "confirmed where testable here"
# the paper explains InfiniGen's gap by its per-step copies over PCIe: where the device is the host there is no bus
NO_BUS = "not testable on this machine (no host-device bus: host and device are one memory, InfiniGen reads its host " \
         "tier in place)"


NOT_RUN = "not run in this profile"  # its experiment has no results here (the confirmatory profile runs two of five)


FINDINGS = {
    1: "full-matrix prefill runs out of memory at ~10K tokens; fused attention rescues InfiniGen, chunked prefill "
       "rescues H2O (tested: where full-matrix prefill runs out of the configured device memory in the grid, InfiniGen "
       "fused and H2O chunked complete)",
    2: "vLLM has the lowest TTFT and the highest decode throughput, H2O a similar peak throughput (~3x vLLM's per GB of "
       "device memory), InfiniGen an order of magnitude below it (tested as one family of claims, Holm: at the "
       "largest batch, H2O's decode throughput within +-10 % of vLLM's, vLLM faster than InfiniGen, vLLM / InfiniGen "
       "within a factor of sqrt(10) of 10x where a host-device bus carries InfiniGen's fetches, H2O's throughput per "
       "GB within a factor of sqrt(2) of 3x vLLM's; at batch 1, vLLM's TTFT below H2O's and InfiniGen's)",
    3: "InfiniGen's host memory grows with batch; H2O's is small (tested: InfiniGen's host peak larger at the largest "
       "batch than at the smallest, and above H2O's there)",
    4: "at budget 0.5 H2O and InfiniGen are near the full cache; at 0.1 InfiniGen loses ~6 pp on average and H2O "
       "more (tested as four claims over every item of the tasks the full cache passes: at 0.5 each drop within "
       "+-5 pp; at 0.1 InfiniGen's drop inside 1-11 pp, and H2O's change from InfiniGen a loss)",
    5: "retention: InfiniGen within a few pp of the full cache, H2O 17-27 pp lower and worse with longer contexts "
       "(tested as three claims over the buckets the full cache passes: InfiniGen's drop within +-5 pp; H2O's inside "
       "17-27 pp widened by 5 pp, refuted where its interval misses 12-32 pp; H2O's drop in the longest bucket larger "
       "than in the shortest)",
}


def verdict_table(frames: dict[str, pd.DataFrame], gate: float = GATE) -> pd.DataFrame:
    """One row per finding of the paper: our verdict (confirmed, refuted, inconclusive, not testable on this machine,
    not run in this profile) and the numbers behind it. 1-3 from the systems experiments (OOM boundaries, the timing
    rule's comparisons, booked host memory), 4 and 5 from the paired drops against the full cache where it passes the
    validity gate."""
    def frame(name):
        return frames.get(name, pd.DataFrame())

    rows = [_prefill_finding(frame("ttft")), _throughput_finding(frame("batch_scaling")),
            _host_memory_finding(frame("batch_scaling")), _accuracy_finding(frame("accuracy"), gate),
            _retention_finding(frame("retention"), gate)]
    return pd.DataFrame([(n, FINDINGS[n], verdict, numbers) for n, (verdict, numbers) in enumerate(rows, 1)],
                        columns=["finding", "paper", "verdict", "numbers"])


CHAPTERS = {1: ("ttft", "Time to first token"), 2: ("batch_scaling", "Batch scaling"),
            3: ("batch_scaling", "Batch scaling"), 4: ("accuracy", "Accuracy across KV budgets"),
            5: ("retention", "Retention of an early fact")}


def _paper_claim(paper: str) -> str:
    """The paper's words without the parenthesis saying how we test them (the evidence section says that)."""
    return paper.split(" (tested")[0]


def verdict_markdown(table: pd.DataFrame, error_rate: bool = True) -> str:
    """The verdict table as the findings page opens with it: the page's error rate (`error_rate`: False where the
    table is shown away from its page, as README does), then the paper's claim and our verdict, one line each; the
    numbers follow per finding (`evidence_markdown`)."""
    lines = ([FINDINGS_FAMILY.statement(), ""] if error_rate else []) + ["| # | the paper | our verdict |",
                                                                        "|---|---|---|"]
    lines += [f"| {r.finding} | {_paper_claim(r.paper)} | **{r.verdict}** |" for r in table.itertuples()]
    return "\n".join(lines)


def evidence_markdown(table: pd.DataFrame) -> str:
    """Each finding's evidence: how it is tested, the numbers one to a line, and the chapter they come from."""
    out = []
    for r in table.itertuples():
        chapter, title = CHAPTERS[r.finding]
        tested = r.paper[len(_paper_claim(r.paper)):].strip(" ()")
        out.append(f"### Finding {r.finding}: {r.verdict}\n\n*The paper:* {_paper_claim(r.paper)}."
                   + (f" *Tested:* {tested.removeprefix('tested').strip(': ')}." if tested else "")
                   + f" *From:* [{title}]({chapter}.ipynb).\n")
        out += [f"- {part}" for part in r.numbers.split("; ")]
        out.append("")
    return "\n".join(out)


def _combined(verdicts: list[str]) -> str:
    """Several claims make one finding: refuted if any is, confirmed only if all are (all that this machine can test,
    said so, where some cannot be)."""
    tested = [v for v in verdicts if v != NOT_TESTABLE]
    if not tested:
        return NOT_TESTABLE if verdicts else INCONCLUSIVE
    if REFUTED in tested:
        return REFUTED
    if all(v == CONFIRMED for v in tested):
        return CONFIRMED if len(tested) == len(verdicts) else CONFIRMED_WHERE_TESTABLE
    return INCONCLUSIVE


def _prefill_finding(df: pd.DataFrame) -> tuple[str, str]:
    if df.empty or "prefill" not in df:
        return NOT_RUN, "the TTFT experiment has no results"
    oom = df["oom"].astype(bool)
    full_oom = df[oom & (df["prefill"] == "full")]
    if full_oom.empty:
        longest = df.loc[df["prefill"] == "full", "prompt_tokens"].max()
        return INCONCLUSIVE, f"full-matrix prefill completed every length of the grid (up to {longest:,} tokens)"
    boundary = int(full_oom["prompt_tokens"].min())
    capacity = df["device_capacity_gb"].dropna().iloc[0] if "device_capacity_gb" in df and \
        df["device_capacity_gb"].notna().any() else None
    parts, claims = [f"full-matrix prefill out of device memory from {boundary:,} tokens"
                     + (f" (a configured {capacity:g} GB capacity, not an 80 GB H100)" if capacity else "")], []
    for policy, rescue in (("infinigen", "fused"), ("h2o", "chunked")):
        g = df[(df["policy"] == policy) & (df["prefill"] == rescue) & (df["prompt_tokens"] >= boundary)]
        if g.empty:
            claims.append(INCONCLUSIVE)
            continue
        rescued = not g["oom"].astype(bool).any()
        claims.append(CONFIRMED if rescued else REFUTED)
        parts.append(f"{policy} with {rescue} prefill {'completes' if rescued else 'also runs out'} at "
                     f"{int(g['prompt_tokens'].max()):,} tokens")
    return _combined(claims), "; ".join(parts)


def throughput_claims(df: pd.DataFrame) -> tuple[list[stats.RangeClaim], int | None]:
    """Finding 2 as the family of claims the verdict rests on, at the largest batch every claim's runners completed:
    the paper's words as ranges of ratios of geometric means (kvlib.report.stats.range_claim). The device peaks are
    booked bytes, the same every run, so a throughput-per-GB claim is a throughput claim with its range scaled."""
    outside = outside_label(df)
    d = df[~df["oom"].astype(bool)]
    if outside is None or d.empty:
        return [], None
    big = d[d["batch_size"] == d["batch_size"].max()]
    runs = {p: stats.by_round(g, "decode_tokens_per_s") for p, g in big.groupby("policy")}
    device = big.groupby("policy")["device_peak_bytes"].median()
    claims = []
    if outside in runs:
        if "h2o" in runs:  # the paper: "similar peak throughput", "comparable to vLLM"
            margin = 1 + stats.EQUIVALENCE_TIMING
            claims.append(stats.range_claim(f"h2o's decode throughput within +-{stats.EQUIVALENCE_TIMING:.0%} of "
                                            f"{outside}'s", runs["h2o"], runs[outside], 1 / margin, margin))
        if "infinigen" in runs:
            claims.append(stats.range_claim(f"{outside} faster than infinigen", runs[outside], runs["infinigen"], 1.0))
        if "infinigen" in runs and not one_memory(df):
            claims.append(stats.range_claim(f"{outside} / infinigen an order of magnitude (10x within a factor of "
                                            f"sqrt(10))", runs[outside], runs["infinigen"], 10 / 10**0.5, 10 * 10**0.5))
        if "h2o" in runs:
            # booked peaks are the same every run: per GB is each run's throughput over a constant
            per_gb = {p: runs[p] / (device[p] / 1e9) for p in ("h2o", outside)}
            claims.append(stats.range_claim(f"h2o's throughput per GB ~3x {outside}'s (within a factor of sqrt(2))",
                                            per_gb["h2o"], per_gb[outside], 3 / 2**0.5, 3 * 2**0.5))
        claims += _lowest_ttft(d, outside)
    return claims, int(big["batch_size"].iloc[0])


def _lowest_ttft(d: pd.DataFrame, outside: str) -> list[stats.RangeClaim]:
    """The paper's "vLLM delivers the lowest TTFT", at the smallest batch (one request's prefill, no queue): each of
    H2O's and InfiniGen's TTFT over vLLM's above 1."""
    if "ttft_s" not in d:
        return []
    small = d[d["batch_size"] == d["batch_size"].min()]
    runs = {p: stats.by_round(g, "ttft_s") for p, g in small.groupby("policy") if g["ttft_s"].notna().any()}
    if outside not in runs:
        return []
    batch = int(small["batch_size"].iloc[0])
    return [stats.range_claim(f"{outside}'s TTFT below {p}'s at batch {batch}", runs[p], runs[outside], 1.0)
            for p in ("h2o", "infinigen") if p in runs]


def one_memory(df: pd.DataFrame) -> bool:
    """The rows ran where host and device are one memory (a CPU): no bus for a tier's copies to cross."""
    return "device_name" in df and bool((df["device_name"] == "cpu").all())


def _throughput_finding(df: pd.DataFrame) -> tuple[str, str]:
    if df.empty:
        return NOT_RUN, "the batch-scaling experiment has no results"
    if outside_label(df) is None:
        return NOT_TESTABLE, "no vLLM rows (the real vLLM did not run here)"
    claims, batch = throughput_claims(df)
    if not claims:
        return INCONCLUSIVE, "vLLM, H2O or InfiniGen did not run at the largest batch"
    share = FINDINGS_FAMILY.share("finding 2")
    verdicts = stats.settle(claims, share)
    n = min(min(c.n_a, c.n_b) for c in claims)
    paired = all(c.paired for c in claims)
    parts = [f"{c.name}: {c.ratio:.2f}x, p = {c.p_value:.3f}: {v}" for c, v in zip(claims, verdicts)]
    smallest, first = stats.smallest_p_value(n, n, paired), share / len(claims)
    rule = (f"{len(claims)} claims settled by Holm at this finding's {share:.2%} of the page's error rate, over {n} "
            f"{'rounds' if paired else 'repeats a side'}: the smallest p-value they can give, {smallest:.4f}, "
            + ("is under Holm's first threshold " if smallest <= first else "is above Holm's first threshold ")
            + f"{first:.4f}" + ("" if smallest <= first else ", so no claim can be settled at these rounds"))
    if one_memory(df):
        parts.append(f"{outside_label(df)} / infinigen an order of magnitude: {NO_BUS}")
        verdicts = [*verdicts, NOT_TESTABLE]
    return _combined(verdicts), f"decode throughput at batch {batch} (TTFT where named): " + "; ".join(parts) + f"; {rule}"


def _host_memory_finding(df: pd.DataFrame) -> tuple[str, str]:
    """Booked bytes are the same every run (the ledger), so no repeats are needed to read them."""
    if df.empty or "host_peak_bytes" not in df:
        return NOT_RUN, "the batch-scaling experiment has no results"
    d = df[~df["oom"].astype(bool)]
    peaks = d.groupby(["policy", "batch_size"])["host_peak_bytes"].median()
    if "infinigen" not in peaks or "h2o" not in peaks or peaks["infinigen"].size < 2:
        return INCONCLUSIVE, "InfiniGen or H2O ran at fewer than two batch sizes"
    ig, h2o = peaks["infinigen"], peaks["h2o"]
    small, large = ig.index.min(), ig.index.max()
    grows = ig[large] > ig[small]
    h2o_small = large in h2o and h2o[large] < ig[large]
    verdict = CONFIRMED if grows and h2o_small else REFUTED
    h2o_text = f"H2O's {h2o[large] / 2**30:.3f} GiB at batch {large}" if large in h2o else "H2O not at that batch"
    return verdict, (f"InfiniGen's host peak {ig[small] / 2**30:.3f} GiB at batch {small}, {ig[large] / 2**30:.3f} GiB "
                     f"at batch {large}; {h2o_text} (booked bytes, the same every run)")


def _claims_finding(claims: Claims, level: float) -> tuple[str, str]:
    """A finding read from its declared claims (kvlib.report.accuracy_findings): its sizes' reach, then each claim."""
    if claims.unanswered:
        return claims.unanswered
    parts = claims.context + [c.line() for c in claims.claims] + [f"{name}: inconclusive" for name in claims.untested]
    n = len(claims.claims) + len(claims.untested)
    return _combined(claims.verdicts), "; ".join(parts) + f"; {n} claims, each interval at {level:.2%}"


def _accuracy_finding(df: pd.DataFrame, gate: float) -> tuple[str, str]:
    level = FINDINGS_FAMILY.level("finding 4")
    return _claims_finding(accuracy_claims(df, gate, level), level)


def _retention_finding(df: pd.DataFrame, gate: float) -> tuple[str, str]:
    level = FINDINGS_FAMILY.level("finding 5")
    return _claims_finding(retention_claims(df, gate, level), level)
