"""Every benchmark runs at toy sizes under KVLIB_BENCH_SMOKE=1 (tests/house/test_benchmarks.py, in CI), so none can rot
unnoticed; its figures then go to a temporary folder, never to benchmarks/results/."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

SMOKE = os.environ.get("KVLIB_BENCH_SMOKE") == "1"


def sized(full, smoke):
    """The benchmark's real size, or its toy size in smoke mode."""
    return smoke if SMOKE else full


def results_path(name: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="kvlib-bench-")) if SMOKE else Path(__file__).parent / "results"
    return folder / name
