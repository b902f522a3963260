"""Which policy when: read a profile's results and answer, for a workload (prompt length, batch, output length), which
policy decodes fastest and which reaches the first token soonest, among those that fit the device memory and stay
within an accuracy drop. Every figure is a measured one, or a straight line between two measured grid points (said
so); nothing is extrapolated past the grid: a workload beyond it gets the nearest point, and the answer says that.

Evidence per question:
- decode throughput: at batch 1, the decode-length experiment at the output length asked (one long prompt); at a
  larger batch, the batch-scaling experiment (mixed-length prompts, its own output length) at the batch asked;
- TTFT: the TTFT experiment, each policy at its fastest prefill mode, at the prompt length asked;
- memory: the device peak measured at the point used (an OOM there rules the policy out);
- accuracy: the drop against the full cache on the accuracy-scored tasks the full cache passes (the validity gate),
  paired on the items with its interval (at the chooser page's level: kvlib.report.pages.CHOOSER), at the policy's
  budget in the systems experiments or, where that budget
  was not scored, the nearest scored budget below it. Three outcomes against a tolerance: within it (the interval's
  upper end below it on every task), ruled out (the interval's lower end above it on some task), or "cannot tell at
  n items" (the interval spans the tolerance; the answer says about how many items would resolve it), which keeps
  the policy out of the ranking without calling it lossy. Policies that keep and attend every entry (rows say
  `lossless`) lose nothing by construction.
- ties: the runners the timing rule cannot tell from the answer at the grid point read, the answer's pick among
  them accounted for: a step-down max-T over the candidates (kvlib.report.stats.best.compare_with_best) at the
  answer's share for that question, so that among equal runners one is called slower at most at that share; a
  figure interpolated between grid points has no repeats of its own and is said to be untested.
- a runner that preallocates its KV pool from the memory it is given (vLLM) is, below the memory it was measured
  with, "not measured at this capacity", never "does not fit": it would start with a smaller pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kvlib.report import stats
from kvlib.report.choose.evidence import CANNOT_TELL, RULED_OUT, compressed_apart, evidence_for, judge_accuracy
from kvlib.report.gate import GATE
from kvlib.report.measures import decode_kernels, geometric_mean, kernel_note
from kvlib.report.pages import CHOOSER
from kvlib.report.stats.best import compare_with_best
from kvlib.report.study_rows import StudyRows


@dataclass
class Estimate:
    """A figure read at `at` from the measured points `points` (one point: measured there; two: interpolated)."""

    value: float
    at: float
    points: list[float]
    axis: str = ""  # the grid axis read, e.g. "batch"
    beyond_grid: bool = False

    def how(self, unit: str) -> str:
        what = self.axis
        if self.beyond_grid:
            return f"{self.value:.3g} {unit} (measured at {what} {self.points[0]:g}, the grid's nearest: not extrapolated)"
        if len(self.points) == 1:
            return f"{self.value:.3g} {unit} (measured at {what} {self.points[0]:g})"
        return (f"{self.value:.3g} {unit} (interpolated between {what} {self.points[0]:g} and {self.points[1]:g})")


def read_at(curve: pd.Series, x: float, axis: str) -> Estimate | None:
    """curve: values indexed by a grid axis. Linear interpolation inside the grid, the nearest point outside it."""
    curve = curve.dropna().sort_index()
    if curve.empty:
        return None
    xs, ys = curve.index.to_numpy(dtype=float), curve.to_numpy(dtype=float)
    if x in xs:
        return Estimate(float(ys[xs == x][0]), x, [x], axis)
    if x < xs[0] or x > xs[-1]:
        i = 0 if x < xs[0] else -1
        return Estimate(float(ys[i]), x, [float(xs[i])], axis, beyond_grid=True)
    return Estimate(float(np.interp(x, xs, ys)), x, [float(xs[xs < x][-1]), float(xs[xs > x][0])], axis)


@dataclass
class Choice:
    fastest_decode: str | None
    lowest_ttft: str | None
    decode: dict[str, Estimate] = field(default_factory=dict)
    ttft: dict[str, Estimate] = field(default_factory=dict)
    # the states of a policy the answer leaves out, never merged: ruled out (beyond the tolerance, or no measured
    # point fits), cannot tell at n items, accuracy not measured, not measured at this capacity, accuracy not asked
    excluded: dict[str, str] = field(default_factory=dict)  # policy -> why it was ruled out
    undecided: dict[str, str] = field(default_factory=dict)  # policy -> why its accuracy cannot be told yet
    unmeasured: dict[str, str] = field(default_factory=dict)  # policy -> what of its accuracy was not measured
    unmeasured_capacity: dict[str, str] = field(default_factory=dict)  # policy -> the capacity it was measured at
    not_asked: list[str] = field(default_factory=list)  # lossy policies left unranked: no accuracy tolerance given
    notes: list[str] = field(default_factory=list)
    # the policies the findings' timing rule cannot tell from the answer (kvlib.report.stats), where both were measured
    # at the grid point read: a lead inside the noise is no lead
    decode_ties: list[str] = field(default_factory=list)
    ttft_ties: list[str] = field(default_factory=list)
    error_rate: str = ""  # what the answer's tested statements spend together (kvlib.report.pages.CHOOSER)

    def text(self) -> str:
        lines = []
        if self.fastest_decode:
            best = self.decode[self.fastest_decode]
            lines.append(f"Highest decode throughput: {self.fastest_decode}, {best.how('tokens/s')}."
                         f"{_ties(self.decode_ties, best)}")
        if self.lowest_ttft:
            best = self.ttft[self.lowest_ttft]
            lines.append(f"Lowest TTFT: {self.lowest_ttft}, {best.how('s')}.{_ties(self.ttft_ties, best)}")
        if not (self.fastest_decode or self.lowest_ttft):
            lines.append("No policy qualifies.")
        others = [f"{p} {e.value:.3g} tokens/s" for p, e in sorted(self.decode.items(), key=lambda kv: -kv[1].value)]
        if len(others) > 1:
            lines.append("Decode throughput of every qualifying policy: " + ", ".join(others) + ".")
        lines += [f"Ruled out: {p}: {why}." for p, why in sorted(self.excluded.items())]
        lines += [f"Not ranked: {p}: {why}." for p, why in sorted(self.undecided.items())]
        lines += [f"Not measured: {p}: {why}." for p, why in sorted(self.unmeasured.items())]
        lines += [f"Not measured at this capacity: {p}: {why}." for p, why in sorted(self.unmeasured_capacity.items())]
        if self.not_asked:
            lines.append(f"Not ranked, accuracy not asked: {', '.join(self.not_asked)} (they lose entries of the cache "
                         f"or precision, and speed alone would rank them with the full cache; --max-accuracy-drop "
                         f"ranks those within it).")
        return "\n".join(lines + self.notes + ([self.error_rate] if self.error_rate else []))


def choose(rows: StudyRows, prompt_tokens: int, batch: int, output_tokens: int,
           max_accuracy_drop: float | None = None, device_memory_gb: float | None = None, gate: float = GATE,
           rank_lossy: bool = True) -> Choice:
    """rows: the profile's results (it reads TTFT, batch scaling, decode length and accuracy). rank_lossy: with
    no tolerance, whether the lossy policies are ranked by speed with the others (the regimes table's "any" drop)
    or listed apart as accuracy not asked (`kvlib choose` without --max-accuracy-drop)."""
    choice = Choice(None, None)
    batch_df, ttft_df, length_df = rows.batch_scaling, rows.ttft, rows.decode_length
    # one long prompt at batch 1 with the output length varied: the evidence for a single stream
    decode_df, axis, x = ((length_df, "output_tokens", output_tokens) if batch == 1 and not length_df.empty
                          else (batch_df, "batch_size", batch))
    policies = sorted(set(decode_df.get("policy", [])) | set(ttft_df.get("policy", [])))
    alphas = {question: CHOOSER.share(question) for question in ("decode", "TTFT")}
    if max_accuracy_drop is not None:
        accuracy = rows.accuracy
        evidence = evidence_for(accuracy, length_df, batch_df, ttft_df, gate=gate, page=CHOOSER)
        _judge_accuracy(choice, _lossy(policies, decode_df, ttft_df), evidence, max_accuracy_drop,
                        compressed_apart(accuracy, length_df, batch_df, ttft_df))
        choice.notes += _accuracy_length_note(accuracy, evidence, prompt_tokens)
    elif not rank_lossy:
        choice.not_asked = _lossy(policies, decode_df, ttft_df)
    for p in policies:
        if p in choice.excluded or p in choice.undecided or p in choice.unmeasured or p in choice.not_asked:
            continue
        decode = _read(decode_df, p, axis, x, "decode_tokens_per_s", device_memory_gb, choice)
        if decode is not None:
            choice.decode[p] = decode
        ttft = _read(ttft_df, p, "prompt_tokens", prompt_tokens, "ttft_s", device_memory_gb, choice)
        if ttft is not None:
            choice.ttft[p] = ttft
    for p in [*choice.excluded, *choice.unmeasured_capacity]:  # left out by one question, out of both answers
        choice.decode.pop(p, None)
        choice.ttft.pop(p, None)
    _keep_the_main_kernel(choice, decode_df)
    if choice.decode:
        choice.fastest_decode = max(choice.decode, key=lambda p: choice.decode[p].value)
        choice.decode_ties = _within_noise(decode_df, axis, "decode_tokens_per_s", choice.fastest_decode,
                                           choice.decode, alphas["decode"])
    if choice.ttft:
        choice.lowest_ttft = min(choice.ttft, key=lambda p: choice.ttft[p].value)
        choice.ttft_ties = _within_noise(ttft_df, "prompt_tokens", "ttft_s", choice.lowest_ttft, choice.ttft,
                                         alphas["TTFT"])
    unmeasured = sorted(set(choice.decode) - set(ttft_df.get("policy", [])))
    if unmeasured and not ttft_df.empty:
        choice.notes.append(f"TTFT: not measured for {', '.join(unmeasured)} in this profile's TTFT grid; the "
                            f"decode-length results hold their TTFT, each at its own prefill mode.")
    choice.notes += _workload_notes(decode_df, axis, prompt_tokens, output_tokens)
    choice.error_rate = _error_rate(alphas)
    return choice


def _error_rate(alphas: dict[str, float]) -> str:
    return (f"Error rate: the statements a test settles in this answer (ruled out, within the tolerance, faster than "
            f"the runners not listed as not distinguishable) are one family, wrong together with a chance of at most "
            f"{CHOOSER.alpha:.0%}: {CHOOSER.share('accuracy'):.2%} to the accuracy intervals (shared equally among "
            f"them), the decode and TTFT ties at {alphas['decode']:.2%} and {alphas['TTFT']:.2%}, each a max-T over "
            f"the candidates that allows for the pick of the answer (kvlib.report.pages.CHOOSER).")


def _judge_accuracy(choice: Choice, lossy: list[str], evidence: dict, max_accuracy_drop: float,
                    compressed_apart: set[str] = frozenset()) -> None:
    """Each lossy policy against the tolerance: ruled out, cannot tell yet, or its accuracy not measured (within it:
    left in the ranking). compressed_apart: the policies whose accuracy was measured only with their cache compressed
    otherwise than they ran here (no evidence for how they ran)."""
    for p in lossy:
        if p in compressed_apart and p not in evidence:
            choice.unmeasured[p] = ("its accuracy was measured in this profile only with its cache compressed "
                                    "otherwise than its timings ran (`compress_cache`), which says nothing of them")
            continue
        if p not in evidence:
            choice.unmeasured[p] = ("its accuracy was not measured in this profile on a task the full cache "
                                    "passes (the validity gate)")
            continue
        e = judge_accuracy(evidence[p], max_accuracy_drop)
        if e.outcome == RULED_OUT:
            choice.excluded[p] = e.text(max_accuracy_drop)
        elif e.outcome == CANNOT_TELL:
            choice.undecided[p] = e.text(max_accuracy_drop)


def _keep_the_main_kernel(choice: Choice, decode_df: pd.DataFrame) -> None:
    """Where the policies decoded with different kernels, the answer is drawn among the policies of the recorded
    kernel most of them ran (the others dropped from the decode answer, and the note says so)."""
    kernels = decode_kernels(decode_df) if not decode_df.empty else {}
    note = kernel_note(kernels, choice.decode)
    if not note:
        return
    ran = pd.Series([kernels[p] for p in choice.decode if p in kernels])
    recorded = ran[~ran.isin(["mixed", "unrecorded"])]
    main = (recorded if len(recorded) else ran).value_counts().index[0]
    choice.notes.append(f"{note[0].upper()}{note[1:]}; the fastest is chosen among those that ran `{main}`.")
    for p in [p for p in choice.decode if p in kernels and kernels[p] != main]:
        choice.decode.pop(p)


def _within_noise(df: pd.DataFrame, axis: str, value: str, best: str, estimates: dict[str, Estimate], alpha: float
                  ) -> list[str]:
    """The runners measured at the same grid point as the answer that the timing rule cannot tell from it there, the
    pick of the answer among them accounted for (kvlib.report.stats.best.compare_with_best: a max-T over the
    candidates at alpha; TTFT: each runner's fastest prefill mode there). A runner the rule could not test (too few
    repeats) is listed too: nothing shows it slower."""
    point = estimates[best]
    if len(point.points) != 1 or point.beyond_grid:
        return []  # an interpolated figure has no repeats of its own to test (Choice.text says so)

    def runs(policy):
        g = df[(df["policy"] == policy) & (df[axis] == point.at) & ~df["oom"].astype(bool)]
        if "prefill" in g and value == "ttft_s":
            g = g[g["prefill"] == g.groupby("prefill")[value].apply(geometric_mean).idxmin()]
        return stats.by_round(g.dropna(subset=[value]), value)

    rivals = [p for p in sorted(estimates) if p != best and len(estimates[p].points) == 1
              and estimates[p].at == point.at]
    timings = pd.DataFrame({p: runs(p) for p in [best, *rivals]})
    return list(compare_with_best(timings, best, alpha, larger_is_better=value != "ttft_s").ties)


def _ties(policies: list[str], best: Estimate) -> str:
    if len(best.points) != 1 or best.beyond_grid:
        return " Untested: a figure read between or beyond grid points has no repeats of its own to compare."
    return (f" Not distinguishable from it there (allowing for its pick among them): {', '.join(policies)}."
            if policies else "")


def _lossy(policies: list[str], *frames: pd.DataFrame) -> list[str]:
    lossless = set().union(*(lossless_runners(df) for df in frames))
    return [p for p in policies if p not in lossless]


def _accuracy_length_note(accuracy: pd.DataFrame, evidence: dict, prompt_tokens: int) -> list[str]:
    """Where the prompt asked is longer than every accuracy item read (the items' built length, else their document's
    tokens), the answer says so and names the lengths measured: a drop at 512 tokens says little of one at 8K."""
    tasks = {e.task for found in evidence.values() for e in found}
    rows = accuracy[accuracy["task"].isin(tasks)] if "task" in accuracy else accuracy.iloc[:0]
    length = (rows["length"] if "length" in rows else pd.Series(float("nan"), index=rows.index))
    length = length.fillna(rows["doc_tokens"]) if "doc_tokens" in rows else length
    longest = length.groupby(rows["task"]).max().dropna() if len(rows) else pd.Series(dtype=float)
    if longest.empty or prompt_tokens <= longest.max():
        return []
    measured = ", ".join(f"{task} {n:,.0f}" for task, n in longest.sort_index().items())
    return [(f"Accuracy: your {prompt_tokens:,}-token prompt is longer than every accuracy item read (tokens, at "
             f"most: {measured}): what a policy loses at your length was not measured.")]


def lossless_runners(df: pd.DataFrame) -> set[str]:
    return set(df.loc[df["lossless"].fillna(False).astype(bool), "policy"]) if "lossless" in df else set()


def preallocates(g: pd.DataFrame) -> bool:
    """A runner that sizes its KV pool from the memory it is given (vLLM: 0.9 x capacity less the weights), so its
    device peak is that pool whatever the workload: below the memory it was measured with it would start with a
    smaller pool, which was not measured."""
    return bool(g.get("outside", pd.Series(False, index=g.index)).fillna(False).astype(bool).any()
                and pd.to_numeric(g.get("device_kv_reserved_peak_bytes", pd.Series(dtype=float)),
                                  errors="coerce").fillna(0).gt(0).any())


def _fits(g: pd.DataFrame, device_memory_gb: float | None) -> pd.DataFrame:
    """Points that completed and whose measured device peak fits the memory asked (no memory asked: completed)."""
    ok = g[~g["oom"].astype(bool)]
    if device_memory_gb is not None:
        ok = ok[ok["device_peak_bytes"] <= device_memory_gb * 2**30]
    return ok


def _read(df, policy, axis, x, value, device_memory_gb, choice) -> Estimate | None:
    """The policy's `value` at `x` on `axis`: the geometric mean of the repeats at each grid point, TTFT at the
    fastest prefill mode of each length."""
    if df.empty:
        return None
    g = df[df["policy"] == policy]
    ok = _fits(g, device_memory_gb)
    if preallocates(g) and len(ok) < len(g[~g["oom"].astype(bool)]):
        peak = pd.to_numeric(g["device_peak_bytes"], errors="coerce").max() / 2**30
        choice.unmeasured_capacity.setdefault(policy, f"it preallocates its KV pool from the memory it is given: "
                                                      f"measured with a {peak:.2f} GiB device peak, above the "
                                                      f"{device_memory_gb:g} GiB asked; with less it would start "
                                                      f"with a smaller pool")
        return None
    by = [axis, "prefill"] if "prefill" in ok and value == "ttft_s" else [axis]
    curve = ok.groupby(by)[value].apply(geometric_mean)
    curve = curve.groupby(axis).min() if len(by) > 1 else curve
    estimate = read_at(curve, x, axis.replace("_size", "").replace("_", " "))
    if estimate is None:
        if not g.empty:
            choice.excluded.setdefault(policy, "no measured point fits (out of memory, or a measured device peak "
                                               "above the memory given)")
        return None
    return None if _excluded_at(g, ok, axis, estimate, policy, choice) else estimate


def _excluded_at(g, ok, axis, estimate, policy, choice) -> bool:
    """A grid point at or below the one asked where nothing fitted (no prefill mode, for TTFT) rules the policy out:
    it would not fit there either (memory grows with the batch and the prompt)."""
    failed = sorted(set(g[axis]) - set(ok[axis]))
    beyond = [x for x in failed if x <= max(estimate.points + [estimate.at])]
    if not beyond:
        return False
    choice.excluded.setdefault(policy, f"does not fit at {estimate.axis} {min(beyond):g} (out of memory, or a measured "
                                       f"device peak above the memory given)")
    return True


def _workload_notes(df: pd.DataFrame, axis: str, prompt_tokens: int, output_tokens: int) -> list[str]:
    """What the decode figures were measured on, and whether the workload asked differs from it."""
    if df.empty:
        return []
    if axis == "output_tokens":
        lo = hi = df["prompt_tokens"].iloc[0]
        shape = f"one prompt of {lo:g} tokens at batch 1"
        out_differs = False
    else:
        lo, hi, out = df["min_prompt_tokens"].min(), df["max_prompt_tokens"].max(), df["max_new_tokens"].iloc[0]
        shape = f"mixed prompts of {lo:g}-{hi:g} tokens with {out:g} output tokens"
        out_differs = output_tokens != out
    notes = [f"Decode throughput: measured on {shape}."]
    if not lo <= prompt_tokens <= hi or out_differs:
        notes.append(f"Your workload ({prompt_tokens} prompt, {output_tokens} output tokens) differs from that: the "
                     f"ranking is read at the measured shape, not extrapolated to yours.")
    return notes
