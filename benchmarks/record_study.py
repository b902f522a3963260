"""The key figures of a computed study, as one JSON file: what a run on another machine (a lent GPU, say) leaves
behind for the record, next to the benchmarks' own results.

    python benchmarks/record_study.py --profiles smoke embedded --out benchmarks/results/cuda_h100.json

Reads results/<profile>/<experiment>/*.parquet (written by `kvlib study`, e.g. with --compute-only) and keeps, per
experiment, the grid axes and the measured columns the book's figures use.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvlib.study import results

MEASURED = ["repeat", "ttft_s", "decode_tokens_per_s", "decode_tokens_per_s_q1", "decode_tokens_per_s_q3",
            "decode_step_s_mean", "device_peak_bytes", "device_kv_bytes", "host_peak_bytes", "oom",
            "stat_kv_share_attended", "disturbed", "others_cpu_share"]
KEEP = {
    "ttft": ["policy", "prefill", "prompt_tokens", *MEASURED],
    "batch_scaling": ["policy", "batch_size", *MEASURED],
    "decode_length": ["policy", "output_tokens", *MEASURED],
}


def record(profile: str) -> dict:
    out: dict = {}
    for experiment, columns in KEEP.items():
        df = results.load(profile, experiment)
        if df.empty:
            continue
        out["run"] = {k: df[k].iloc[0] for k in ("device_name", "torch_version", "transformers_version", "git_sha")}
        cols = [c for c in columns if c in df.columns]
        df = df[cols].sort_values(cols[:3 if experiment == "ttft" else 2])
        out[experiment] = json.loads(df.to_json(orient="records", double_precision=6))
    accuracy = results.load(profile, "accuracy")
    if not accuracy.empty:
        from kvlib.report.accuracy.tables import accuracy_table

        out["accuracy"] = json.loads(accuracy_table(accuracy).to_json(orient="records", double_precision=6))
    retention = results.load(profile, "retention")
    if not retention.empty:
        table = retention.groupby(["policy", "bucket", "turn"])["correct"].mean().reset_index()
        out["retention"] = json.loads(table.to_json(orient="records", double_precision=6))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", nargs="+", default=["smoke"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.write_text(json.dumps({p: record(p) for p in args.profiles}, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
