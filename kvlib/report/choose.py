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
  paired on the items with its 95 % interval, at the policy's budget in the systems experiments or, where that budget
  was not scored, the nearest scored budget below it. Three outcomes against a tolerance: within it (the interval's
  upper end below it on every task), ruled out (the interval's lower end above it on some task), or "cannot tell at
  n items" (the interval spans the tolerance; the answer says about how many items would resolve it), which keeps
  the policy out of the ranking without calling it lossy. Policies that keep and attend every entry (rows say
  `lossless`) lose nothing by construction.
- ties: the runners the timing rule cannot tell from the answer at the grid point read, with the family-wise error
  over the candidates held by Holm (kvlib.report.stats.holm); a figure interpolated between grid points has no
  repeats of its own and is said to be untested.
- a runner that preallocates its KV pool from the memory it is given (vLLM) is, below the memory it was measured
  with, "not measured at this capacity", never "does not fit": it would start with a smaller pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kvlib.report import stats
from kvlib.report.gate import GATE, accuracy_gate, passing
from kvlib.report.tables import accuracy_item, accuracy_table, decode_kernels, geometric_mean, kernel_note


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
    excluded: dict[str, str] = field(default_factory=dict)  # policy -> why it was ruled out
    undecided: dict[str, str] = field(default_factory=dict)  # policy -> why its accuracy cannot be told yet
    notes: list[str] = field(default_factory=list)
    # the policies the findings' timing rule cannot tell from the answer (kvlib.report.stats), where both were measured
    # at the grid point read: a lead inside the noise is no lead
    decode_ties: list[str] = field(default_factory=list)
    ttft_ties: list[str] = field(default_factory=list)

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
        return "\n".join(lines + self.notes)


WITHIN, RULED_OUT, CANNOT_TELL = "within the tolerance", "ruled out", "cannot tell"


@dataclass
class AccuracyEvidence:
    """A lossy policy's drop against the full cache where it was read: the task whose interval decides (the largest
    upper end), the budget read, and, against a tolerance, the outcome."""

    drop: stats.Drop
    task: str
    where: str
    outcome: str | None = None  # WITHIN, RULED_OUT or CANNOT_TELL, once judged against a tolerance

    def text(self, tolerance: float | None = None) -> str:
        d = self.drop
        measured = (f"measured drop {d.drop * 100:.1f} pp on {self.task} at {self.where}, 95 % interval "
                    f"{d.low * 100:.1f} to {d.high * 100:.1f} pp over {d.items} items")
        if self.outcome == RULED_OUT:
            return f"loses more than the {tolerance:g} pp allowed ({measured}: its lower end is above it)"
        if self.outcome == CANNOT_TELL:
            return (f"cannot tell at {d.items} items whether it stays within {tolerance:g} pp: the interval spans "
                    f"{d.low * 100:.1f} to {d.high * 100:.1f} pp (measured drop {d.drop * 100:.1f} pp on {self.task} at "
                    f"{self.where}); {items_to_resolve(d, tolerance)}")
        return measured


def items_to_resolve(drop: stats.Drop, tolerance: float) -> str:
    """About how many items would put the interval on one side of the tolerance, if the measured drop held: an
    interval's half-width falls as 1 / sqrt(items)."""
    half = (drop.high - drop.low) / 2
    distance = abs(drop.drop * 100 - tolerance) / 100
    if distance < 1e-9:
        return "no number of items would: the measured drop is at the tolerance"
    return f"about {math.ceil(drop.items * (half / distance) ** 2):,} items would resolve it"


def accuracy_evidence(accuracy: pd.DataFrame, budgets: dict[str, float | None], gate: float = GATE
                      ) -> dict[str, list[AccuracyEvidence]]:
    """Per lossy policy, its paired drop on each accuracy-scored task the full cache passes (the validity gate: no
    accuracy statement from a task the model fails), at the policy's budget in the systems experiments or the nearest
    scored budget below it. budgets: the policy's budget there (None: not a budgeted policy)."""
    if accuracy.empty:
        return {}
    table = accuracy_table(accuracy)
    table = table[table["metric"] == "accuracy"]
    gated = accuracy_gate(accuracy, gate)
    valid = passing(gated[gated["length"].isna()], "task")
    rows = accuracy[accuracy["ruler_score"].isna()] if "ruler_score" in accuracy else accuracy
    rows = rows.assign(budget=rows["budget"].fillna(1.0) if "budget" in rows else 1.0)
    item = accuracy_item(rows)
    out = {}
    for policy, g in table[table["policy"] != "full"].groupby("policy"):
        budget = budgets.get(policy)
        scored = sorted(g["budget"].unique())
        below = [b for b in scored if budget is None or b <= budget + 1e-9]
        used = below[-1] if below else scored[0]
        where = f"budget {used:g}" + ("" if budget is None or abs(used - budget) < 1e-9
                                      else f" (the nearest scored budget {'below' if below else 'above'} {budget:g})")
        out[policy] = [AccuracyEvidence(stats.paired_drop(rows[(rows["task"] == task) & (rows["policy"] == "full")],
                                                          rows[(rows["task"] == task) & (rows["policy"] == policy)
                                                               & (rows["budget"] == used)], "correct", item),
                                        task, where)
                       for task in g.loc[g["budget"] == used, "task"] if task in valid]
        if not out[policy]:
            del out[policy]
    return out


def judge_accuracy(evidence: list[AccuracyEvidence], tolerance: float) -> AccuracyEvidence:
    """The outcome against a tolerance (pp): ruled out where any passing task's interval lies above it, within it
    where every task's lies below, else cannot tell; the evidence returned is the deciding task's."""
    for e in evidence:
        e.outcome = (RULED_OUT if e.drop.low * 100 > tolerance else WITHIN if e.drop.high * 100 < tolerance
                     else CANNOT_TELL)
    for outcome in (RULED_OUT, CANNOT_TELL):
        hits = [e for e in evidence if e.outcome == outcome]
        if hits:
            return max(hits, key=lambda e: e.drop.high)
    return max(evidence, key=lambda e: e.drop.high)


def choose(frames: dict[str, pd.DataFrame], prompt_tokens: int, batch: int, output_tokens: int,
           max_accuracy_drop: float | None = None, device_memory_gb: float | None = None, gate: float = GATE
           ) -> Choice:
    """frames: the profile's results by experiment (ttft, batch_scaling, decode_length, accuracy)."""
    choice = Choice(None, None)
    batch_df = frames.get("batch_scaling", pd.DataFrame())
    ttft_df = frames.get("ttft", pd.DataFrame())
    length_df = frames.get("decode_length", pd.DataFrame())
    # one long prompt at batch 1 with the output length varied: the evidence for a single stream
    decode_df, axis, x = ((length_df, "output_tokens", output_tokens) if batch == 1 and not length_df.empty
                          else (batch_df, "batch_size", batch))
    policies = sorted(set(decode_df.get("policy", [])) | set(ttft_df.get("policy", [])))
    budgets = {}
    for df in (batch_df, ttft_df):
        if "budget" in df:
            budgets.update(df.dropna(subset=["budget"]).groupby("policy")["budget"].first().to_dict())
    lossless = _lossless(decode_df) | _lossless(ttft_df)
    if max_accuracy_drop is not None:
        evidence = accuracy_evidence(frames.get("accuracy", pd.DataFrame()), budgets, gate)
        for p in policies:
            if p in lossless:
                continue
            if p not in evidence:
                choice.excluded[p] = ("its accuracy was not measured in this profile on a task the full cache passes "
                                      "(the validity gate)")
                continue
            e = judge_accuracy(evidence[p], max_accuracy_drop)
            if e.outcome == RULED_OUT:
                choice.excluded[p] = e.text(max_accuracy_drop)
            elif e.outcome == CANNOT_TELL:
                choice.undecided[p] = e.text(max_accuracy_drop)
    for p in policies:
        if p in choice.excluded or p in choice.undecided:
            continue
        decode = _read(decode_df, p, axis, x, "decode_tokens_per_s", device_memory_gb, choice)
        if decode is not None:
            choice.decode[p] = decode
        ttft = _read(ttft_df, p, "prompt_tokens", prompt_tokens, "ttft_s", device_memory_gb, choice)
        if ttft is not None:
            choice.ttft[p] = ttft
    for p in choice.excluded:  # ruled out by one question, out of both answers
        choice.decode.pop(p, None)
        choice.ttft.pop(p, None)
    kernels = decode_kernels(decode_df) if not decode_df.empty else {}
    note = kernel_note(kernels, choice.decode)
    if note:  # the answer is drawn among the policies of the recorded kernel most of them ran
        ran = pd.Series([kernels[p] for p in choice.decode if p in kernels])
        recorded = ran[~ran.isin(["mixed", "unrecorded"])]
        main = (recorded if len(recorded) else ran).value_counts().index[0]
        choice.notes.append(f"{note[0].upper()}{note[1:]}; the fastest is chosen among those that ran `{main}`.")
        for p in [p for p in choice.decode if p in kernels and kernels[p] != main]:
            choice.decode.pop(p)
    if choice.decode:
        choice.fastest_decode = max(choice.decode, key=lambda p: choice.decode[p].value)
        choice.decode_ties = _within_noise(decode_df, axis, "decode_tokens_per_s", choice.fastest_decode,
                                           choice.decode)
    if choice.ttft:
        choice.lowest_ttft = min(choice.ttft, key=lambda p: choice.ttft[p].value)
        choice.ttft_ties = _within_noise(ttft_df, "prompt_tokens", "ttft_s", choice.lowest_ttft, choice.ttft)
    unmeasured = sorted(set(choice.decode) - set(ttft_df.get("policy", [])))
    if unmeasured and not ttft_df.empty:
        choice.notes.append(f"TTFT: this profile's TTFT grid does not run {', '.join(unmeasured)} (their TTFT at "
                            f"their own prefill is in the decode-length results).")
    choice.notes += _workload_notes(decode_df, axis, prompt_tokens, output_tokens)
    return choice


def _within_noise(df: pd.DataFrame, axis: str, value: str, best: str, estimates: dict[str, Estimate]) -> list[str]:
    """The runners measured at the same grid point as the answer that the timing rule cannot tell from it there, the
    family-wise error over the candidates held by Holm (TTFT: each runner's fastest prefill mode at that point). A
    runner the rule could not test (too few repeats) is listed too: nothing shows it slower."""
    point = estimates[best]
    if len(point.points) != 1 or point.beyond_grid:
        return []  # an interpolated figure has no repeats of its own to test (Choice.text says so)

    def runs(policy):
        g = df[(df["policy"] == policy) & (df[axis] == point.at) & ~df["oom"].astype(bool)]
        if "prefill" in g and value == "ttft_s":
            g = g[g["prefill"] == g.groupby("prefill")[value].apply(geometric_mean).idxmin()]
        return stats.by_round(g.dropna(subset=[value]), value)

    reference = runs(best)
    rivals = [p for p in sorted(estimates) if p != best and len(estimates[p].points) == 1
              and estimates[p].at == point.at]
    tests = [stats.compare_timings(runs(p), reference) for p in rivals]
    rejected = stats.holm([c.p_value if c.judged else math.nan for c in tests])
    return [p for p, r in zip(rivals, rejected) if not r]


def _ties(policies: list[str], best: Estimate) -> str:
    if len(best.points) != 1 or best.beyond_grid:
        return " Untested: a figure read between or beyond grid points has no repeats of its own to compare."
    return (f" Not distinguishable from it there (Holm over the candidates): {', '.join(policies)}."
            if policies else "")


def _lossless(df: pd.DataFrame) -> set[str]:
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
        choice.excluded.setdefault(policy, f"not measured at this capacity (it preallocates its KV pool from the "
                                           f"memory it is given: measured with a {peak:.2f} GiB device peak, above "
                                           f"the {device_memory_gb:g} GiB asked; with less it would start with a "
                                           f"smaller pool)")
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


def regimes(frames: dict[str, pd.DataFrame], tolerances=(None, 5.0, 1.0), memories=None) -> pd.DataFrame:
    """The chooser's answer over regimes: device memory x the grid's shortest/longest prompt x smallest/largest batch
    x shortest/longest output x accuracy tolerance; each row computed by `choose`, nothing written per policy.
    memories: device memory limits in GiB (None: what the profile's capacity allowed); by default that and
    `tight_memory_gb`, where some runners no longer fit at the largest batch."""
    prompts, batches, outputs = _grid(frames)
    if memories is None:
        memories = tuple(dict.fromkeys([None, tight_memory_gb(frames.get("batch_scaling", pd.DataFrame()))]))
    rows = []
    for memory in memories:
        for prompt in dict.fromkeys([prompts[0], prompts[-1]]):
            for b in dict.fromkeys([batches[0], batches[-1]]):
                for out in dict.fromkeys([outputs[0], outputs[-1]]):
                    for tol in tolerances:
                        c = choose(frames, int(prompt), int(b), int(out), tol, memory)
                        rows.append({"device memory (GiB)": "profile's" if memory is None else f"{memory:g}",
                                     "prompt tokens": prompt, "batch": b, "output tokens": out,
                                     "accuracy drop allowed (pp)": "any" if tol is None else f"{tol:g}",
                                     "fastest decode": _named(c.fastest_decode, c.decode, "{:.1f} tok/s"),
                                     "decode, not distinguishable": ", ".join(c.decode_ties) or "-",
                                     "lowest TTFT": _named(c.lowest_ttft, c.ttft, "{:.3g} s"),
                                     "TTFT, not distinguishable": ", ".join(c.ttft_ties) or "-",
                                     "ruled out": ", ".join(sorted(c.excluded)) or "-",
                                     "cannot tell": ", ".join(sorted(c.undecided)) or "-"})
    return pd.DataFrame(rows)


def largest_workload(frames: dict[str, pd.DataFrame], output_tokens: int = 32, max_accuracy_drop: float = 5.0
                     ) -> Choice:
    """The chooser's answer for the grid's largest batch and longest prompt (what the chooser chapter prints in full);
    a profile that measured neither (accuracy and retention only) gets the answer for batch 1 and no prompt, which
    says what is missing."""
    prompts, batches, _ = _grid(frames)
    return choose(frames, int(prompts[-1]), int(batches[-1]), output_tokens, max_accuracy_drop)


def _grid(frames: dict[str, pd.DataFrame]) -> tuple[list, list, list]:
    """The prompt lengths, batch sizes and output lengths the profile measured, in order (0, 1 and 0 where it did
    not)."""
    batch_df, ttft_df, length_df = (frames.get(k, pd.DataFrame()) for k in ("batch_scaling", "ttft", "decode_length"))
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

SERVING_PERCENTILE = "p90"  # a runner meets a limit at a rate where 90 % of its requests are within it
_LIMIT_NAMES = {"ttft_s": "TTFT", "tpot_s": "TPOT"}


@dataclass
class ServingChoice:
    """Which runners meet the SLO at a request rate, from the serving results, and the accuracy each loses."""

    rate: float
    slo: dict[str, float]  # ttft_s, tpot_s
    capacity_gb: float | None = None  # the device capacity the serving results read were measured at
    meets: dict[str, dict[str, Estimate]] = field(default_factory=dict)  # runner -> {"ttft_s": .., "tpot_s": ..}
    misses: dict[str, str] = field(default_factory=dict)  # runner -> which limit it misses, with the figure
    excluded: dict[str, str] = field(default_factory=dict)  # runner -> why it was not read (memory, accuracy, rate)
    accuracy: dict[str, str] = field(default_factory=dict)  # runner -> the accuracy it loses, as read
    notes: list[str] = field(default_factory=list)

    def text(self) -> str:
        limits = " and ".join(f"{SERVING_PERCENTILE} {name} <= {self.slo[key]:g} s"
                              for key, name in _LIMIT_NAMES.items() if key in self.slo)
        where = "no configured device capacity" if self.capacity_gb is None else f"{self.capacity_gb:g} GiB"
        lines = [f"At {self.rate:g} requests/s with {limits or 'no SLO given'} (serving results at {where}):"]
        if self.meets:
            ranked = sorted(self.meets.items(), key=lambda kv: [e.value for e in kv[1].values()])
            lines.append("Meet it: " + "; ".join(f"{p} ({self._figures(got)}{self._accuracy(p)})"
                                                 for p, got in ranked) + ".")
        else:
            lines.append("No runner measured meets it.")
        lines += [f"Misses it: {p}: {why}{self._accuracy(p)}." for p, why in sorted(self.misses.items())]
        lines += [f"Not read: {p}: {why}." for p, why in sorted(self.excluded.items())]
        return "\n".join(lines + self.notes)

    def _accuracy(self, policy: str) -> str:
        return f"; {self.accuracy[policy]}" if policy in self.accuracy else ""

    @staticmethod
    def _figures(got: dict[str, Estimate]) -> str:
        return ", ".join(f"{SERVING_PERCENTILE} {_LIMIT_NAMES[k]} {e.how('s')}" for k, e in got.items())


def choose_serving(serving: pd.DataFrame, accuracy: pd.DataFrame, rate: float, slo_ttft_s: float | None = None,
                   slo_tpot_s: float | None = None, max_accuracy_drop: float | None = None,
                   device_memory_gb: float | None = None) -> ServingChoice:
    """Which runners meet the SLO (their p90 TTFT and p90 TPOT within the limits given) at `rate`, read from the
    serving results by the chooser's rules: measured at the rate, or interpolated between the two measured rates
    around it; below the grid's lowest rate, its lowest rate is read (latency does not fall as the load rises) and
    the answer says so; above its highest, nothing is read (never extrapolated). Memory: the results measured at the
    largest capacity that is no larger than `device_memory_gb` (a larger memory only adds blocks); none such, no
    answer. Accuracy as in `choose`: the largest plausible loss against the full cache, lossless runners none."""
    slo = {k: v for k, v in (("ttft_s", slo_ttft_s), ("tpot_s", slo_tpot_s)) if v is not None}
    choice = ServingChoice(rate, slo)
    if serving.empty:
        choice.notes.append("No serving results in this profile: `kvlib study --experiments serving` computes them.")
        return choice
    d = serving.assign(oom=serving["oom"].fillna(False).astype(bool))
    capacities = d["device_capacity_gb"].dropna().unique() if "device_capacity_gb" in d else []
    if device_memory_gb is not None:
        fitting = sorted(c for c in capacities if c <= device_memory_gb + 1e-12)
        if not fitting:
            measured = ", ".join(f"{c:g}" for c in sorted(capacities)) or "no configured capacity"
            choice.notes.append(f"Serving was measured at {measured} GiB, none of it within the {device_memory_gb:g} "
                                f"GiB asked: no answer (less memory means fewer blocks; not extrapolated).")
            return choice
        choice.capacity_gb = float(fitting[-1])
        d = d[d["device_capacity_gb"] == fitting[-1]]
    elif len(capacities):
        choice.capacity_gb = float(max(capacities))
        d = d[d["device_capacity_gb"] == max(capacities)]
    budgets = d.dropna(subset=["budget"]).groupby("policy")["budget"].first().to_dict() if "budget" in d else {}
    lossless = _lossless(d)
    evidence = accuracy_evidence(accuracy, budgets) if not accuracy.empty else {}
    for p in sorted(d["policy"].unique()):
        if p in lossless:
            choice.accuracy[p] = "keeps every entry: no accuracy lost"
        elif p in evidence:
            if max_accuracy_drop is None:
                e = max(evidence[p], key=lambda e: e.drop.high)
                choice.accuracy[p] = f"accuracy: {e.text()}"
                continue
            e = judge_accuracy(evidence[p], max_accuracy_drop)
            if e.outcome == WITHIN:
                choice.accuracy[p] = f"accuracy within {max_accuracy_drop:g} pp: {e.text()}"
            else:
                choice.excluded[p] = e.text(max_accuracy_drop)
        elif max_accuracy_drop is not None:
            choice.excluded[p] = "its accuracy was not measured in this profile on a task the full cache passes"
        else:  # a lossy runner with no accuracy read says so rather than nothing
            choice.accuracy[p] = "its accuracy loss was not measured in this profile"
    rates = sorted(d["request_rate"].unique())
    if rate < rates[0]:
        choice.notes.append(f"{rate:g} requests/s is below the lowest rate measured; read at {rates[0]:g} requests/s "
                            f"(latency at a lower load is no higher).")
    for p, g in d.groupby("policy"):
        if p in choice.excluded:
            continue
        measured = sorted(g["request_rate"].unique())
        if rate > measured[-1]:
            choice.excluded[p] = f"measured only up to {measured[-1]:g} requests/s (not extrapolated)"
            continue
        at = max(rate, measured[0])
        read_up_to = min(x for x in measured if x >= at)  # the highest rate a reading at `at` rests on
        if g.loc[g["oom"], "request_rate"].le(read_up_to).any():
            choice.excluded[p] = f"ran out of device memory at or below {read_up_to:g} requests/s"
            continue
        got, missed = {}, []
        for key, limit in slo.items():
            curve = g[~g["oom"]].groupby("request_rate")[f"{key}_{SERVING_PERCENTILE}"].median()
            estimate = read_at(curve, at, "rate")
            if estimate is None:
                missed.append(f"no {key} measured")
                continue
            got[key] = estimate
            if estimate.value > limit:
                missed.append(f"{SERVING_PERCENTILE} {_LIMIT_NAMES[key]} {estimate.how('s')} > {limit:g} s")
        if missed:
            choice.misses[p] = "; ".join(missed)
        else:
            choice.meets[p] = got
    if not slo:
        choice.notes.append("No SLO given (--slo-ttft, --slo-tpot): every runner measured at this rate meets it.")
    return choice
