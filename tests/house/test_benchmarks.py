"""Every benchmark runs end to end at toy sizes (KVLIB_BENCH_SMOKE=1), so a renamed method or metric cannot break one
unnoticed. Their figures go to a temporary folder; the real runs are `make bench`."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).parents[2] / "benchmarks").glob("bench_*.py"))


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.stem)
def test_benchmark_runs_in_smoke_mode(script):
    if "vllm" in script.stem and importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM (make install-vllm)")
    env = {**os.environ, "KVLIB_BENCH_SMOKE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    recorded = {p: p.stat().st_mtime_ns for p in (script.parent / "results").glob("*.json")}
    proc = subprocess.run([sys.executable, str(script)], cwd=script.parent, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in recorded} == recorded  # a smoke run never overwrites real figures
