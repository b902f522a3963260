"""This machine's limits (kvlib.study.limits measures them: its docstring says how), written to
benchmarks/results/machine.json or the file `--out` names; at toy sizes under KVLIB_BENCH_SMOKE=1."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from smoke import SMOKE, results_path

from kvlib.study.limits import TOY, Sizes, measure


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON (default: "
                        "benchmarks/results/machine.json; a temporary folder under KVLIB_BENCH_SMOKE=1)")
    args = parser.parse_args(argv)
    figures = measure(TOY if SMOKE else Sizes())
    out = args.out or results_path("machine.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
