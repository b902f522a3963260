#!/usr/bin/env bash
# Issue 52's GPU check, one command on a machine with one GPU (PyTorch preinstalled, no network needed):
#
#   bash benchmarks/gpu_check.sh                    # the machine's limits, then params/gpu-check.yaml on its GPU
#   bash benchmarks/gpu_check.sh --toy --device cpu # the same steps at the profile's toy size on a CPU (seconds)
#
# It writes results/gpu-check/ (one parquet file per unit, as `kvlib study` does, machine.json from
# benchmarks/bench_machine.py, and infinigen_gather.json from benchmarks/bench_infinigen_gather.py: InfiniGen's fetch
# taken apart, the host gather, and the copy from pageable memory against a pinned buffer; not yet timed on a GPU, 24 s
# on the 2-core CPU VM at fp32, loaded; the decode steps of `full` and `infinigen` at the paper's shape are the
# study's rows); copy that folder back. With --toy: results/gpu-check-toy[-<device>]/, every step at its toy size.
# The study stops at --time-limit seconds (default 450: with the machine's measures, within 8 minutes),
# keeping every unit stored by then; a rerun computes only the units not stored yet.
#
# Beyond torch, `kvlib study --compute-only` imports transformers, pandas, pyarrow, pyyaml, tqdm and numpy, with
# their own dependencies (transformers: huggingface_hub, tokenizers, safetensors, regex, packaging, filelock;
# pandas: python-dateutil). On a machine without a package registry, carry them as wheels: fetch them (with every
# dependency) where a registry is reachable, for the GPU machine's Python (`python3 --version` there; 3.11 here):
#   pip download --dest wheels/ --python-version 3.11 --platform manylinux_2_28_x86_64 --only-binary=:all: \
#       "transformers>=5.0,<6" "pandas>=2.0" pyarrow pyyaml tqdm numpy
# and install them there: pip install --no-index --find-links wheels/ transformers pandas pyarrow pyyaml tqdm
# (never torch: the machine's own CUDA build stays). This script says which are missing before it runs anything.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

device=""
toy=""
limit=450
while [ $# -gt 0 ]; do
    case $1 in
        --toy) toy=--toy ;;
        --device) device=${2:?--device needs a value}; shift ;;
        --time-limit) limit=${2:?--time-limit needs seconds}; shift ;;
        *) echo "usage: $0 [--toy] [--device DEVICE] [--time-limit SECONDS]" >&2; exit 2 ;;
    esac
    shift
done
study_args=(--profile gpu-check --compute-only ${toy:+--toy} ${device:+--device "$device"})
if [ -n "$toy" ]; then
    export KVLIB_BENCH_SMOKE=1  # the machine's measures at their toy sizes too
fi

missing=$("$PYTHON" -c '
import importlib.util
print(" ".join(m for m in ("torch", "transformers", "pandas", "pyarrow", "yaml", "tqdm", "numpy", "safetensors")
               if importlib.util.find_spec(m) is None))')
if [ -n "$missing" ]; then
    echo "gpu_check: missing Python packages: $missing (see the top of $0 for carrying them as wheels)" >&2
    exit 1
fi
"$PYTHON" -c 'import torch; print("gpu_check: torch", torch.__version__, "CUDA:",
              torch.cuda.get_device_name() if torch.cuda.is_available() else "none")'

name=$("$PYTHON" -c '
import sys
from kvlib.study import load_profile
print(load_profile("gpu-check", sys.argv[1] or None, sys.argv[2] == "--toy").name)' "$device" "$toy")
out="${KVLIB_ROOT:-$PWD}/results/$name"
mkdir -p "$out"

start=$SECONDS
"$PYTHON" benchmarks/bench_machine.py --out "$out/machine.json"
echo "gpu_check: the machine's limits in $((SECONDS - start)) s: $out/machine.json"
"$PYTHON" benchmarks/bench_infinigen_gather.py ${device:+--device "$device"} --out "$out/infinigen_gather.json"
echo "gpu_check: InfiniGen's gather and copy by $((SECONDS - start)) s: $out/infinigen_gather.json"
# SIGINT: the unit under way is dropped (nothing half-written), every finished one is kept
status=0
timeout --signal=INT --kill-after=30 "$limit" "$PYTHON" -m kvlib study "${study_args[@]}" || status=$?
if [ "$status" -ne 0 ]; then
    stored=$(find "$out" -name '*.parquet' | wc -l)
    echo "gpu_check: the study stopped (status $status; 124: the $limit s time limit) with $stored unit(s) stored" \
         "in $out; run it again to compute the rest" >&2
    exit "$status"
fi
echo "gpu_check: done in $((SECONDS - start)) s: copy $out back into results/ of your checkout"
