"""Machines as data: the specs shipped in kvlib/hardware/specs/*.yaml (datasheet figures, each with its source),
this machine's measured by benchmarks/bench_machine.py, and a user's own in a file of the same format.

    from kvlib import hardware
    hardware.names()                    # ['a100_sxm', 'gh200', 'h100_pcie', 'h100_sxm', 'l4', 'this_machine']
    hardware.load("h100_sxm")           # a shipped spec
    hardware.load("path/to/mine.yaml")  # a user's
    hardware.load("this_machine")       # from benchmarks/results/machine.json
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from kvlib.errors import UserError
from kvlib.hardware.spec import Figure, Spec
from kvlib.paths import repo_root

SPECS = Path(__file__).parent / "specs"
THIS_MACHINE = "this_machine"

__all__ = ["Figure", "Spec", "load", "names", "this_machine"]


def names() -> list[str]:
    """The shipped specs, and this machine's."""
    return sorted([p.stem for p in SPECS.glob("*.yaml")] + [THIS_MACHINE])


def load(name_or_path: str | Path) -> Spec:
    """A shipped spec by name, this machine's (`this_machine`), or a spec file (a path ending .yaml/.yml)."""
    text = str(name_or_path)
    if text.replace("-", "_") == THIS_MACHINE:
        return this_machine()
    path = Path(text)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise UserError(f"--hardware {text}: no such file")
    else:
        path = SPECS / f"{text}.yaml"
        if not path.is_file():
            raise UserError(f"--hardware must be one of {names()} or a spec file (.yaml), got {text!r}")
    return Spec.from_dict(yaml.safe_load(path.read_text()), str(path))


def machine_json() -> Path:
    return repo_root() / "benchmarks" / "results" / "machine.json"


def this_machine(path: str | Path | None = None) -> Spec:
    """This machine's spec from bench_machine.py's measures (fp32, torch's threads), its tiers one memory.

    The bandwidth and FLOP rate are the highest of those it measured (a bound must not understate what the machine
    can do): memory read, weights streamed by decode-shaped linears; a large matmul, the decode-shaped linears."""
    path = Path(path) if path is not None else machine_json()
    if not path.is_file():
        raise UserError(f"no measures of this machine at {path}: run `python benchmarks/bench_machine.py` first")
    raw = json.loads(path.read_text())
    linears = raw.get("decode_linears_16_rows") or {}
    where = f"benchmarks/bench_machine.py ({path.name}, {raw.get('threads', '?')} threads)"
    reads = [v for v in (raw.get("read_gb_per_s"), linears.get("weights_gb_per_s")) if v]
    flops = [v for v in (raw.get("matmul_fp32_gflop_per_s"), linears.get("gflop_per_s")) if v]
    if not reads or not flops:
        raise UserError(f"{path}: expected read_gb_per_s and matmul_fp32_gflop_per_s (bench_machine.py's keys)")
    disk = raw.get("disk_read_gb_per_s")  # read where a later bench_machine.py measures it
    return Spec(name=THIS_MACHINE, description=f"this machine, measured ({raw.get('device', 'cpu')})",
                memory_bandwidth=Figure(max(reads) * 1e9, f"measured: {where}, the highest of its read rates"),
                peak_flops={"float32": Figure(max(flops) * 1e9, f"measured: {where}, the highest fp32 rate")},
                device_memory=Figure(raw.get("memory_bytes"),
                                     f"{where}: memory_bytes" if raw.get("memory_bytes") else "not measured"),
                link_bandwidth=None, link_latency=None,
                disk_bandwidth=Figure(disk * 1e9 if disk else None,
                                      f"{where}: disk_read_gb_per_s" if disk else "not measured: not charged"),
                extra=raw)
