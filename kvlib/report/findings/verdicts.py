"""The verdict table that leads the book: each of the paper's five findings, confirmed, refuted or inconclusive
from every experiment's rows, with its claims' outcomes counted and, where refuted, which way. Findings 2, 4 and 5 are
declared families of claims (finding 2's timings settled by Holm; 4 and 5 paired drops against the full cache where
it passes the validity gate); findings 1 and 3 are checks, not tested claims (OOM boundaries at a configured capacity,
booked host memory), outside the page's family."""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import pandas as pd

from kvlib.report import stats
from kvlib.report.accuracy.paper_beside import accuracy_claims
from kvlib.report.accuracy.paper_tasks import read_rows
from kvlib.report.claims import MARGIN, UNTESTED, Claims
from kvlib.report.findings.throughput_claims import one_memory, throughput_claims
from kvlib.report.gate import GATE
from kvlib.report.measures import outside_label
from kvlib.report.pages import FINDINGS as FINDINGS_FAMILY
from kvlib.report.provenance import models
from kvlib.report.retention import claims as retention_claims
from kvlib.report.study_rows import StudyRows

CONFIRMED, REFUTED, INCONCLUSIVE = stats.CONFIRMED, stats.REFUTED, stats.INCONCLUSIVE
NOT_TESTABLE = "not testable on this machine"
# a finding some of whose claims this machine lacks the mechanism for: the rest confirmed
CONFIRMED_WHERE_TESTABLE = "confirmed where testable here"
# the paper explains InfiniGen's gap by its per-step copies over PCIe: where the device is the host there is no bus
NO_BUS = "not testable on this machine (no host-device bus: host and device are one memory, InfiniGen reads its host " \
         "tier in place)"
# findings 1 and 3 as read here cannot fail as tested (a configured capacity; a host tier one policy has by design):
# checks, said so, outside the page's family
CHECKS = (1, 3)
HOLDS, FAILS = "holds as checked", "fails as checked"
CHECK = "a check, not a tested claim"


NOT_RUN = "not run in this profile"  # its experiment has no results here (the confirmatory profile runs two of five)


NUMBERS = "\n"  # between a finding's numbers, each one line of its evidence (a number's words may hold "; ")


class Reading(NamedTuple):
    """A finding as its rows read: the verdict, the numbers behind it, and what its tested claims rest on: (units,
    what a unit is: "items", "rounds"), the fewest of any claim; None for a check, or where nothing was tested."""

    verdict: str
    numbers: str
    sample: tuple[int, str] | None = None


FINDINGS = {
    1: "full-matrix prefill runs out of memory at ~10K tokens; fused attention rescues InfiniGen, chunked prefill "
       "rescues H2O (checked, not a tested claim: where full-matrix prefill runs out of the configured device memory "
       "in the grid, InfiniGen fused and H2O chunked complete; the paper's ~10K tokens is not tested)",
    2: "vLLM has the lowest TTFT and the highest decode throughput, H2O a similar peak throughput (~3x vLLM's per GB of "
       "device memory), InfiniGen an order of magnitude below it (tested as one family of claims, Holm: at the "
       "largest batch of the grid, each claim untested where one of its runners did not complete it, H2O's decode "
       "throughput within +-10 % of vLLM's, vLLM faster than InfiniGen, vLLM / InfiniGen within a factor of sqrt(10) "
       "of 10x where a host-device bus carries InfiniGen's fetches, H2O's throughput per GB within a factor of "
       "sqrt(2) of 3x vLLM's where the configured capacity lets it and \"similar\" both hold; at batch 1, vLLM's TTFT "
       "below H2O's and InfiniGen's)",
    3: "InfiniGen's host memory grows with batch; H2O's is small (checked, not a tested claim: InfiniGen's host peak "
       "larger at the largest batch than at the smallest, and above H2O's there; it holds by construction, InfiniGen "
       "keeping its cache in a host tier and H2O having none)",
    4: "at budget 0.5 H2O and InfiniGen are near the full cache; at 0.1 InfiniGen loses ~6 pp on average and H2O "
       "more; 2-4 % budgets approach random guessing; budget >= 0.3 within 10 pp on most datasets (tested on the "
       "paper's six lm-eval tasks under its harnesses' one-pass protocol, H2O under its official budget rule, as "
       "eight claims on the task average of the tasks whose full cache beats chance: at 0.5 each drop within +-5 pp; "
       "at 0.1 InfiniGen's drop inside 1-11 pp and H2O's change from InfiniGen a loss; at the smallest budget each "
       "policy's score within 5 pp of chance; at 0.3 each policy's drop below 10 pp on more than half the tasks)",
    5: "retention: the full cache 94-96 %, InfiniGen within a few pp of it, H2O 17-27 pp lower and worse with longer "
       "contexts (tested as three claims over the buckets the full cache passes: InfiniGen's drop within +-5 pp; "
       "H2O's inside 17-27 pp widened by 5 pp, refuted where its interval misses 12-32 pp; H2O's drop in the longest "
       "bucket larger than in the shortest; the full cache's 94-96 % is not tested, the validity gate picking the "
       "buckets by that score)",
}


def checks_sentence() -> str:
    """Why findings 1 and 3 stand outside the page's family, said under its error rate and in README."""
    return (f"Findings 1 and 3 are checks, not tested claims: finding 1 reads where full-matrix prefill runs out of a "
            f"configured device capacity on the grid's prompt lengths and never tests the paper's ~10K tokens, and "
            f"finding 3 holds by construction (InfiniGen keeps its cache in a host tier, H2O has none), so neither can "
            f"fail as tested; they stand outside the family and spend none of its {FINDINGS_FAMILY.alpha:.0%}.")


def family_sentence(books: int = 1) -> str:
    """README's sentence on the verdicts' error rate (the findings page says it above its table), where its tested
    verdicts come from `books` reference books, each its own family: their error rates add up."""
    if books == 1:
        rate = (f"Findings 2, 4 and 5 are one family of tested claims: the chance that any of their verdicts is wrong "
                f"is at most {FINDINGS_FAMILY.alpha:.0%}. ")
    else:
        rate = (f"Findings 2, 4 and 5 are tested claims, one family in each reference book, the chance that any "
                f"verdict of a family is wrong at most {FINDINGS_FAMILY.alpha:.0%}: this table reads {books} books, so "
                f"the chance that any of its tested verdicts is wrong is at most {books * FINDINGS_FAMILY.alpha:.0%}. ")
    return rate + checks_sentence()


def verdict_table(rows: StudyRows, gate: float = GATE) -> pd.DataFrame:
    """One row per finding of the paper: our verdict (confirmed, refuted, inconclusive, not testable on this machine or
    on these rows, not run in this profile), the numbers behind it and what its tested claims rest on (`sample_n`
    `sample_of`: the fewest units of any claim, "items", "conversations", "rounds"; none for a check). 1-3 from the
    systems experiments (OOM boundaries, the timing rule's comparisons, booked host memory), 4 and 5 from the paired
    drops against the full cache where it passes the validity gate."""
    found = [_prefill_finding(rows.ttft), _throughput_finding(rows.batch_scaling),
             _host_memory_finding(rows.batch_scaling), _accuracy_finding(rows.accuracy, gate),
             _retention_finding(rows.retention, gate)]
    read = [rows.ttft, rows.batch_scaling, rows.batch_scaling, read_rows(rows.accuracy),
            rows.retention]  # the rows each verdict reads, whose model(s) it names
    table = pd.DataFrame([(n, FINDINGS[n], r.verdict, r.numbers, models(rows_read))
                          for n, (r, rows_read) in enumerate(zip(found, read), 1)],
                         columns=["finding", "paper", "verdict", "numbers", "model"])
    # (object columns: a check has no sample, and None stays None in reference.json)
    table["sample_n"] = pd.Series([r.sample[0] if r.sample else None for r in found], dtype=object)
    table["sample_of"] = pd.Series([r.sample[1] if r.sample else None for r in found], dtype=object)
    return table


def _paper_claim(paper: str) -> str:
    """The paper's words without the parenthesis saying how we test them (the evidence section says that)."""
    return paper.split(" (tested")[0].split(" (checked")[0]


def verdict_markdown(table: pd.DataFrame, error_rate: bool = True) -> str:
    """The verdict table as the findings page opens with it: the page's error rate and why findings 1 and 3 stand
    outside it (`error_rate`: False where the table is shown away from its page, as README does), then the paper's
    claim and our verdict, one line each; the numbers follow per finding (`evidence_markdown`)."""
    lines = ([FINDINGS_FAMILY.statement() + " " + checks_sentence(), ""] if error_rate else [])
    named, booked = "model" in table, "reference" in table
    lines += ["| # | the paper | our verdict |" + (" measured with |" if named else "")
              + (" reference book | sample |" if booked else ""),
              "|---|---|---|" + ("---|" if named else "") + ("---|---|" if booked else "")]
    lines += [f"| {r.finding} | {_paper_claim(r.paper)} | **{r.verdict}** |" + (f" {r.model or '-'} |" if named else "")
              + (f" {r.reference} | {sample_text(r.sample_n, r.sample_of)} |" if booked else "")
              for r in table.itertuples()]
    return "\n".join(lines)


def sample_text(n, of) -> str:
    """What a verdict's tested claims rest on, as its table says it: "500 items", or "-" for a check."""
    return f"{int(n):,} {of}" if n is not None and not pd.isna(n) else "-"


def evidence_markdown(table: pd.DataFrame, chapters: dict[int, tuple[str, str]]) -> str:
    """Each finding's evidence: how it is tested (or checked), the numbers one to a line, and the chapter they come
    from (`chapters`: finding -> the chapter's file stem and title, as the experiments declare them:
    kvlib.study.experiment.finding_chapters)."""
    out = []
    for r in table.itertuples():
        chapter, title = chapters[r.finding]
        how = r.paper[len(_paper_claim(r.paper)):].strip(" ()")
        checked = how.startswith("checked")
        label = "Checked, not a tested claim" if checked else "Tested"
        what = how.removeprefix("checked, not a tested claim" if checked else "tested").strip(": ")
        out.append(f"### Finding {r.finding}: {r.verdict}\n\n*The paper:* {_paper_claim(r.paper)}."
                   + (f" *{label}:* {what}." if how else "")
                   # a finding the profile did not run has no chapter in its book to point to
                   + ("" if r.verdict.startswith(NOT_RUN) else f" *From:* [{title}]({chapter}.ipynb).") + "\n")
        out += [f"- {part}" for part in r.numbers.split(NUMBERS)]
        out.append("")
    return "\n".join(out)


def _combined(verdicts: list[str]) -> str:
    """Several claims make one finding: refuted if any is, confirmed only if all are (all that this machine can test,
    said so, where some cannot be), else inconclusive. An untested claim counts as inconclusive. The verdict's text
    (`_verdict`) counts the claims' outcomes and says which way a refutation goes, so that a finding whose central
    claim holds is not read as wholly refuted."""
    tested = [v for v in verdicts if v != NOT_TESTABLE]
    if not tested:
        return NOT_TESTABLE if verdicts else INCONCLUSIVE
    if REFUTED in tested:
        return REFUTED
    if all(v == CONFIRMED for v in tested):
        return CONFIRMED if len(tested) == len(verdicts) else CONFIRMED_WHERE_TESTABLE
    return INCONCLUSIVE


OUTCOMES = {REFUTED: "refuted", CONFIRMED: "confirmed", INCONCLUSIVE: "inconclusive", UNTESTED: "untested",
            NOT_TESTABLE: "not testable here"}  # in the order a tally names them


def tally(verdicts: list[str]) -> str:
    """The claims' outcomes in counts: "1 of 5 claims refuted, 1 confirmed, 3 inconclusive"."""
    counts = Counter(verdicts)
    if counts[CONFIRMED] == len(verdicts):
        return f"all {len(verdicts)} claims confirmed"
    first, *rest = [w for w in OUTCOMES if counts[w]]
    return ", ".join([f"{counts[first]} of {len(verdicts)} claims {OUTCOMES[first]}"]
                     + [f"{counts[w]} {OUTCOMES[w]}" for w in rest])


def _verdict(verdicts: list[str], refuted_as: list[str]) -> str:
    """A finding's verdict as the table shows it: the word (`_combined`), then which way each refutation goes and
    the claims' tally ("refuted: H2O loses more than the paper reports (1 of 3 claims refuted, 2 inconclusive)")."""
    word = _combined(verdicts)
    if word == REFUTED:
        return f"{word}: {'; '.join(dict.fromkeys(refuted_as))} ({tally(verdicts)})"
    return f"{word}: {tally(verdicts)}"


def _check(results: list[str]) -> str:
    """A check's verdict (findings 1 and 3): holds where every part does, fails where one does, else inconclusive."""
    word = FAILS if REFUTED in results else HOLDS if results and all(r == CONFIRMED for r in results) else INCONCLUSIVE
    return f"{word}: {CHECK}"


def _prefill_finding(df: pd.DataFrame) -> Reading:
    if df.empty or "prefill" not in df:
        return Reading(NOT_RUN, "the TTFT experiment has no results")
    oom = df["oom"].astype(bool)
    full_oom = df[oom & (df["prefill"] == "full")]
    lengths = sorted(df["prompt_tokens"].unique())
    why = (f"{CHECK}: it reads where full-matrix prefill runs out of a configured capacity on the grid's "
           f"{len(lengths)} prompt lengths ({', '.join(f'{n:,}' for n in lengths)}) and does not test the paper's "
           f"~10K tokens")
    if full_oom.empty:
        longest = df.loc[df["prefill"] == "full", "prompt_tokens"].max()
        return Reading(f"{INCONCLUSIVE}: {CHECK}", (f"full-matrix prefill completed every length of the grid (up to "
                       f"{longest:,} tokens){NUMBERS}{why}"))
    boundary = int(full_oom["prompt_tokens"].min())
    capacity = df["device_capacity_gb"].dropna().iloc[0] if "device_capacity_gb" in df and \
        df["device_capacity_gb"].notna().any() else None
    parts, claims = [f"full-matrix prefill out of device memory from {boundary:,} tokens"
                     + (f" (a configured {capacity:g} GiB capacity, not an 80 GB H100)" if capacity else "")], []
    for policy, rescue in (("infinigen", "fused"), ("h2o", "chunked")):
        g = df[(df["policy"] == policy) & (df["prefill"] == rescue) & (df["prompt_tokens"] >= boundary)]
        if g.empty:
            claims.append(INCONCLUSIVE)
            continue
        rescued = not g["oom"].astype(bool).any()
        claims.append(CONFIRMED if rescued else REFUTED)
        parts.append(f"{policy} with {rescue} prefill {'completes' if rescued else 'also runs out'} at "
                     f"{int(g['prompt_tokens'].max()):,} tokens")
    return Reading(_check(claims), NUMBERS.join(parts + [why]))


def _throughput_finding(df: pd.DataFrame) -> Reading:
    if df.empty:
        return Reading(NOT_RUN, "the batch-scaling experiment has no results")
    outside = outside_label(df)
    if outside is None:
        return Reading(NOT_TESTABLE, "no vLLM rows (the real vLLM did not run here)")
    family = throughput_claims(df)
    if not family.claims and not family.untested:
        return Reading(INCONCLUSIVE, "vLLM, H2O and InfiniGen did not run")
    share = FINDINGS_FAMILY.share("finding 2")
    verdicts = stats.settle(family.claims, share) if family.claims else []
    parts = family.notes + [f"{c.name}: {c.ratio:.2f}x, p = {c.p_value:.3f}: {v}"
                            for c, v in zip(family.claims, verdicts)] + family.untested
    refuted_as = [below if c.ratio < c.low else above
                  for c, v, (below, above) in zip(family.claims, verdicts, family.refuted_as) if v == REFUTED]
    verdicts += [UNTESTED] * len(family.untested)
    if family.claims:
        n = min(min(c.n_a, c.n_b) for c in family.claims)
        paired = all(c.paired for c in family.claims)
        smallest, first = stats.smallest_p_value(n, n, paired), share / len(family.claims)
        parts.append(f"{len(family.claims)} claims settled by Holm at this finding's {share:.2%} of the page's error "
                     f"rate, over {n} {'rounds' if paired else 'repeats a side'}: the smallest p-value they can give, "
                     f"{smallest:.4f}, "
                     + ("is under Holm's first threshold " if smallest <= first else "is above Holm's first threshold ")
                     + f"{first:.4f}" + ("" if smallest <= first else ", so no claim can be settled at these rounds"))
    if one_memory(df):
        parts.append(f"{outside} / infinigen an order of magnitude: {NO_BUS}")
        verdicts.append(NOT_TESTABLE)
    cannot = "; it cannot be confirmed at the configured capacity" if family.unconfirmable else ""
    sample = (int(n), "rounds" if paired else "repeats a side") if family.claims else None
    return Reading(_verdict(verdicts, refuted_as) + cannot,
                   f"decode throughput at batch {family.batch} (TTFT where named): " + NUMBERS.join(parts), sample)


def _host_memory_finding(df: pd.DataFrame) -> Reading:
    """Booked bytes are the same every run (the ledger), so no repeats are needed to read them; and InfiniGen keeps
    its cache in a host tier that H2O does not have, so the finding holds by construction: a check."""
    if df.empty or "host_peak_bytes" not in df:
        return Reading(NOT_RUN, "the batch-scaling experiment has no results")
    d = df[~df["oom"].astype(bool)]
    peaks = d.groupby(["policy", "batch_size"])["host_peak_bytes"].median()
    if "infinigen" not in peaks or "h2o" not in peaks or peaks["infinigen"].size < 2:
        return Reading(f"{INCONCLUSIVE}: {CHECK}", "InfiniGen or H2O ran at fewer than two batch sizes")
    ig, h2o = peaks["infinigen"], peaks["h2o"]
    small, large = ig.index.min(), ig.index.max()
    grows = ig[large] > ig[small]
    h2o_small = large in h2o and h2o[large] < ig[large]
    h2o_text = f"H2O's {h2o[large] / 2**30:.3f} GiB at batch {large}" if large in h2o else "H2O not at that batch"
    return Reading(_check([CONFIRMED if grows and h2o_small else REFUTED]), (
        f"InfiniGen's host peak {ig[small] / 2**30:.3f} GiB at batch {small}, {ig[large] / 2**30:.3f} GiB at batch "
        f"{large}{NUMBERS}{h2o_text} (booked bytes, the same every run)"
        f"{NUMBERS}{CHECK}: InfiniGen keeps its cache in a host tier "
        f"and H2O has none, so it holds by construction"))


def _claims_finding(claims: Claims, level: float) -> Reading:
    """A finding read from its declared claims (kvlib.report.claims): its sizes' reach, then each claim."""
    if claims.unanswered:
        return Reading(*claims.unanswered)
    parts = claims.context + [c.line() for c in claims.claims] + [f"{name}: {UNTESTED}" for name in claims.untested]
    n = len(claims.claims) + len(claims.untested)
    refuted_as = [c.refuted_as for c in claims.claims if c.verdict == REFUTED]
    verdict = _verdict(claims.verdicts, refuted_as)
    if _combined(claims.verdicts) == INCONCLUSIVE:
        verdict = "; ".join([verdict, *claims.limits, *filter(None, [_sizes(claims)])])
    sample = (int(min(c.drop.clusters for c in claims.claims)), claims.claims[0].units) if claims.claims else None
    return Reading(verdict, NUMBERS.join([*parts, f"{n} claims, each interval at {level:.2%}"]), sample)


def _sizes(claims: Claims) -> str | None:
    """Why the claims left open stay open, from their intervals: how wide they are at these sizes against the margin
    the claims are read with (the reason an inconclusive verdict gives, not a direction it does not have)."""
    open_claims = [c for c in claims.claims if c.verdict == INCONCLUSIVE]
    if not open_claims:
        return None
    halves = sorted((c.drop.high - c.drop.low) / 2 * 100 for c in open_claims)
    n, units = min(c.drop.clusters for c in open_claims), open_claims[0].units
    widths = f"+-{halves[0]:.0f}" + (f" to +-{halves[-1]:.0f}" if round(halves[-1]) != round(halves[0]) else "")
    lead = f"too few {units}: " if halves[0] > MARGIN * 100 else ""
    return (f"{lead}at {n:,} {units} its open claims' intervals are {widths} pp wide, the claims' margin "
            f"+-{MARGIN * 100:g} pp")


def _accuracy_finding(df: pd.DataFrame, gate: float) -> Reading:
    level = FINDINGS_FAMILY.level("finding 4")
    return _claims_finding(accuracy_claims(df, gate, level), level)


def _retention_finding(df: pd.DataFrame, gate: float) -> Reading:
    level = FINDINGS_FAMILY.level("finding 5")
    return _claims_finding(retention_claims(df, gate, level), level)
