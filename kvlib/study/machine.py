"""Which machine computed a result row: host, CPU model and the instruction sets the kernels use, GPU, Ray node.

A timing says as much about the machine as about the policy: a grid computed on a Ray cluster of unlike machines
would otherwise mix their speeds in one figure without a word. Every row carries these columns, and the findings
compare timings only between rows of one kind of machine (CPU model and GPU: kvlib.report.measures.machine_kind).
"""

from __future__ import annotations

import functools
import hashlib
import platform
import socket
import sys

# the instruction sets that change what a CPU kernel runs (oneDNN's, kvlib's C kernel's): x86 vector widths, the
# matrix units, and their ARM counterparts; every other flag only enters the digest
RELEVANT_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                  "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "asimdhp", "sve", "sve2", "bf16", "i8mm")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model(info: dict[str, str]) -> str:
    """x86 names its model; ARM gives an implementer and a part number instead."""
    if info.get("model name"):
        return info["model name"]
    if info.get("CPU part"):
        return f"ARM implementer {info.get('CPU implementer', '?')} part {info['CPU part']}"
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_flags(info: dict[str, str]) -> set[str]:
    return set((info.get("flags") or info.get("Features") or "").split())


def _gpu() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


@functools.lru_cache(maxsize=1)
def _hardware() -> dict:
    """What does not change while a process lives (read once per process: /proc/cpuinfo has a block per core)."""
    info = _cpuinfo()
    flags = cpu_flags(info)
    return {"machine_host": socket.gethostname(), "machine_cpu": cpu_model(info),
            "machine_cpu_flags": " ".join(f for f in RELEVANT_FLAGS if f in flags),
            "machine_cpu_flags_digest": hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:12],
            "machine_gpu": _gpu()}


def ray_node_id() -> str | None:
    """The Ray node this process runs on, when it is a Ray worker (or a connected driver); None otherwise. Ray is
    never imported here: a process that has not imported it is not under Ray."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()


def machine() -> dict:
    """The columns naming the machine that computes here: machine_host, machine_cpu, machine_cpu_flags (the
    relevant ones), machine_cpu_flags_digest (of them all), machine_gpu (None: no GPU), machine_ray_node."""
    return {**_hardware(), "machine_ray_node": ray_node_id()}
