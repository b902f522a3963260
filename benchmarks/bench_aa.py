"""An A/A test of the book's timing verdicts: the same policy entered twice under two names, measured as the book
measures a point, judged by the book's rule. Two equal engines must read "within noise" (or "too few repeats").

`full` and `full_twin` (the same class under another name, registered here only) each run the embedded profile's
batch-scaling point (its mixed prompts and new tokens) at batch 8 REPEATS times, interleaved as the
study interleaves repeats (every runner once, then every runner again, the order alternating), each unit through
`run_timed` (an untimed run, then a timed one). The verdict is the book's rule (`kvlib.report.stats.compare_timings`) on the
two runners' decode throughputs and on their TTFTs.

    python benchmarks/bench_aa.py

Writes benchmarks/results/aa.json.
"""

from __future__ import annotations

import dataclasses
import json
import os

from smoke import SMOKE, results_path, sized

REPEATS = sized(5, 2)
BATCH = sized(8, 2)


def main() -> None:
    from kvlib import study
    from kvlib.models.workloads import mixed_length_prompts
    from kvlib.policies.full import FullPolicy
    from kvlib.policies.registry import register
    from kvlib.report import stats
    from kvlib.study.experiments.common import model_of, run_timed
    from kvlib.study.kept import Kept

    @register
    @dataclasses.dataclass
    class FullTwin(FullPolicy):
        name = "full_twin"

    point = max((p for p in study.load_profile("embedded").points("batch_scaling") if p.runner == "full"),
                key=lambda p: p.values["batch_size"])  # its prompts and lengths; the batch is this benchmark's
    point = dataclasses.replace(point, values={**point.values, "batch_size": BATCH,
                                               **({"max_new_tokens": 3, "max_prompt_tokens": 32} if SMOKE else {})})
    v = point.values
    kept = Kept()
    prompts = mixed_length_prompts(model_of(point, kept).tokenizer, v["batch_size"], v["min_prompt_tokens"] if not SMOKE
                                   else 16, v["max_prompt_tokens"], seed=v.get("seed", 0), source=v.get("text_source"))
    runners = {"full": point, "full_twin": dataclasses.replace(point, runner="full_twin")}
    rows: dict[str, list[dict]] = {name: [] for name in runners}
    for r in range(REPEATS):
        for name in (list(runners) if r % 2 == 0 else list(runners)[::-1]):
            row = run_timed(runners[name], kept, prompts, v["max_new_tokens"])
            rows[name].append({"decode_tokens_per_s": row["decode_tokens_per_s"], "ttft_s": row["ttft_s"]})
            print(f"repeat {r} {name}: {row['decode_tokens_per_s']:.1f} tok/s, TTFT {row['ttft_s']:.3f} s", flush=True)
    verdicts = {}
    for column in ("decode_tokens_per_s", "ttft_s"):
        a, b = ([x[column] for x in rows[name]] for name in runners)
        c = stats.compare_timings(a, b)
        verdicts[column] = {"ratio": c.ratio, "low": c.low, "high": c.high, "p_value": c.p_value,
                            "verdict": c.verdict}
        print(f"{column}: full / full_twin = {c.ratio:.3f} (95 % interval {c.low:.3f}-{c.high:.3f}), p = "
              f"{c.p_value:.3f}: {c.verdict}", flush=True)
    out = results_path("aa.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "method": f"full and full_twin (the same policy under two names), the embedded batch-scaling point at batch "
                  f"{BATCH}, {REPEATS} repeats interleaved in alternating order, each through run_timed; verdict: "
                  f"kvlib.report.stats.compare_timings ({stats.timing_rule()})",
        "load_average": os.getloadavg(), "smoke": SMOKE, "rows": rows, "verdicts": verdicts}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
