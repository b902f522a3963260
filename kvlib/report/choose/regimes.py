"""The chooser over regimes (device memory x prompt x batch x output x accuracy tolerance), every row computed by
`choose`, and the one workload the chooser chapter prints in full."""

from __future__ import annotations

import math

import pandas as pd

from kvlib.report.choose.workload import Choice, choose
from kvlib.report.pages import CHOOSER
from kvlib.report.study_rows import StudyRows


def regimes(rows: StudyRows, tolerances=(None, 5.0, 1.0), memories=None) -> pd.DataFrame:
    """The chooser's answer over regimes: device memory x the grid's shortest/longest prompt x smallest/largest batch
    x shortest/longest output x accuracy tolerance; each row computed by `choose`, nothing written per policy.
    memories: device memory limits in GiB (None: what the profile's capacity allowed); by default that and
    `tight_memory_gb`, where some runners no longer fit at the largest batch."""
    prompts, batches, outputs = _grid(rows)
    if memories is None:
        memories = tuple(dict.fromkeys([None, tight_memory_gb(rows.batch_scaling)]))
    table = []
    for memory in memories:
        for prompt in dict.fromkeys([prompts[0], prompts[-1]]):
            for b in dict.fromkeys([batches[0], batches[-1]]):
                for out in dict.fromkeys([outputs[0], outputs[-1]]):
                    for tol in tolerances:
                        c = choose(rows, int(prompt), int(b), int(out), tol, memory)
                        table.append({"device memory (GiB)": "profile's" if memory is None else f"{memory:g}",
                                     "prompt tokens": prompt, "batch": b, "output tokens": out,
                                     "accuracy drop allowed (pp)": "any" if tol is None else f"{tol:g}",
                                     "fastest decode": _named(c.fastest_decode, c.decode, "{:.1f} tok/s"),
                                     "decode, not distinguishable": ", ".join(c.decode_ties) or "-",
                                     "lowest TTFT": _named(c.lowest_ttft, c.ttft, "{:.3g} s"),
                                     "TTFT, not distinguishable": ", ".join(c.ttft_ties) or "-",
                                     "ruled out": ", ".join(sorted(c.excluded)) or "-",
                                     "cannot tell": ", ".join(sorted(c.undecided)) or "-",
                                     "accuracy not measured": ", ".join(sorted(c.unmeasured)) or "-",
                                     "not measured at this capacity": ", ".join(sorted(c.unmeasured_capacity))
                                     or "-"})
    return pd.DataFrame(table)


REGIME = ["device memory (GiB)", "prompt tokens", "batch", "output tokens", "accuracy drop allowed (pp)"]
QUESTIONS = {"Which decodes fastest?": ["fastest decode", "decode, not distinguishable"],
             "Which reaches the first token soonest?": ["lowest TTFT", "TTFT, not distinguishable"],
             "Which are out of the answer, and why?": ["ruled out", "cannot tell", "accuracy not measured",
                                                        "not measured at this capacity"]}


def error_rate_statement() -> str:
    """The chooser page's error rate, said once at its top: one family per answer (kvlib.report.pages.CHOOSER says
    why not per page)."""
    return (f"**One error rate per answer.** Each row of the tables below is one answer to one workload, as `kvlib "
            f"choose` gives it: its tested statements (ruled out, within the tolerance, faster than the runners not "
            f"listed as not distinguishable) are one family, wrong together with a chance of at most "
            f"{CHOOSER.alpha:.0%} ({CHOOSER.shares()}: the accuracy intervals share theirs equally, the ties are a "
            f"max-T over the answer's candidates that allows for the pick of the answer). Rows that read the same "
            f"grid point repeat the same tests, so the table is not one family (as one, each share would be "
            f"divided among every grid point its question reads). Words that say a difference was not shown "
            f"(cannot tell, not distinguishable) cannot be false positives and spend nothing.")


def by_question(table: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """`regimes` as one small table per question, indexed by the regime: narrow enough for a page."""
    return {question: table.set_index(REGIME)[columns] for question, columns in QUESTIONS.items()}


def largest_workload(rows: StudyRows, output_tokens: int = 32, max_accuracy_drop: float = 5.0
                     ) -> Choice:
    """The chooser's answer for the grid's largest batch and longest prompt (what the chooser chapter prints in full);
    a profile that measured neither (accuracy and retention only) gets the answer for batch 1 and no prompt, which
    says what is missing."""
    prompts, batches, _ = _grid(rows)
    return choose(rows, int(prompts[-1]), int(batches[-1]), output_tokens, max_accuracy_drop)


def _grid(rows: StudyRows) -> tuple[list, list, list]:
    """The prompt lengths, batch sizes and output lengths the profile measured, in order (0, 1 and 0 where it did
    not)."""
    batch_df, ttft_df, length_df = rows.batch_scaling, rows.ttft, rows.decode_length
    prompts = sorted(ttft_df["prompt_tokens"].unique()) if not ttft_df.empty else [0]
    batches = sorted(batch_df["batch_size"].unique()) if not batch_df.empty else [1]
    outputs = sorted(length_df["output_tokens"].unique()) if not length_df.empty else [0]
    return prompts, batches, outputs


def tight_memory_gb(batch_df: pd.DataFrame) -> float | None:
    """A device memory at which the largest batch no longer fits every runner: the median of the runners' measured
    device peaks there (each runner's median over repeats), rounded down to 0.01 GiB; None without a measured peak."""
    if batch_df.empty or "device_peak_bytes" not in batch_df:
        return None
    top = batch_df[(batch_df["batch_size"] == batch_df["batch_size"].max()) & ~batch_df["oom"].astype(bool)]
    peaks = pd.to_numeric(top["device_peak_bytes"], errors="coerce").groupby(top["policy"]).median().dropna()
    return None if peaks.empty else math.floor(peaks.median() / 2**30 * 100) / 100


def _named(policy, estimates, fmt) -> str:
    return "-" if policy is None else f"{policy} ({fmt.format(estimates[policy].value)})"


# ---- serving: which runners meet an SLO at a request rate (kvlib.study.experiments.serving) --------------------------
