"""A policy's decode step on a GPU, projected from kernel times others measured: NVIDIA's aiconfigurator-core.

A step is aiconfigurator's per-op times for vLLM on that GPU at (batch, the KV length the policy actually attends):
its measured GEMMs (QKV, output projection, MLP, LM head) and its measured generation attention (at the full length
for the layers a policy keeps dense, at the attended length for the others), plus the small ops aiconfigurator
models empirically; plus the policy's selection work at the spec's roofline (kvlib.projection.bound); plus its
counted transfers over the spec's link, serialized after the step (as kvlib's InfiniGen runs on CUDA) and
overlapped with it (as InfiniGen's official code prefetches): both are given. It is an estimate from measurements,
not a bound; each figure names the aiconfigurator version and the kernel data version it read.

Why aiconfigurator-core and not genz-llm, llm-analysis or vidur: it ships kernel timings *measured* on the GPUs
readers have (H100 SXM, H200, A100, GB200, ...), for vLLM, by batch and KV length, and answers offline from a pip
wheel under Apache 2.0. genz-llm and llm-analysis are analytic rooflines (what kvlib.projection.bound already is);
vidur's profiles need traces collected on the GPU itself. It is optional: `pip install aiconfigurator-core` (kvlib's
`projection` extra); without it these functions say so and the bound still answers.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping

from kvlib.errors import UserError
from kvlib.hardware import Spec
from kvlib.projection.bound import phase_times, transfer_time

BACKEND = "vllm"
# kvlib's model names -> aiconfigurator's (it reads the architecture from its own copy of the published config)
MODELS = {"llama-3.1-8b": "meta-llama/Meta-Llama-3.1-8B", "llama-3.1-70b": "meta-llama/Meta-Llama-3.1-70B"}
ATTENTION = "generation_attention"


def available() -> bool:
    try:
        import aiconfigurator_core  # noqa: F401
    except ImportError:
        return False
    return True


def _require() -> None:
    if not available():
        raise UserError("GPU kernel times need NVIDIA's aiconfigurator-core: pip install aiconfigurator-core "
                        "(kvlib's `projection` extra); the bound (kvlib.projection.bound) needs nothing more")


def versions(system: str) -> dict:
    """The aiconfigurator version and the kernel data version its vLLM tables for `system` are read from."""
    _require()
    from importlib.metadata import version

    from aiconfigurator_core.sdk.perf_database import get_version_slots

    slots = get_version_slots(system, BACKEND) or {}
    if not slots.get("current"):
        raise UserError(f"aiconfigurator-core has no measured {BACKEND} kernel tables for {system!r}")
    return {"aiconfigurator_version": version("aiconfigurator-core"), "kernel_system": system,
            "kernel_data_version": f"{BACKEND} {slots['current']}"}


@functools.lru_cache(maxsize=8)
def engine(model: str, system: str):
    """aiconfigurator's compiled engine for a model on a system, pinned to the data version `versions` names."""
    _require()
    from aiconfigurator_core.sdk.engine import EngineHandle

    data = versions(system)["kernel_data_version"].split()[-1]
    # it warns of every table of other ops (MLA, DSA) it falls back to; none of those serve a Llama
    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)
    return EngineHandle.compile(MODELS.get(model, model), system, BACKEND, backend_version=data)


def kernel_step(model: str, system: str, batch: int, kv_length: int, full_length: int | None = None,
                full_layers_share: float = 0.0) -> dict:
    """aiconfigurator's decode step in ms at (batch, kv_length), its attention a mix where `full_layers_share` of the
    layers attend `full_length` (InfiniGen's dense layers): total, attention, the rest, and the share of the step's
    time from ops aiconfigurator measured ('silicon') rather than modelled ('empirical')."""
    ops = {name: (ms, source) for name, ms, _, source in engine(model, system).decode_step_per_op(batch, kv_length, 2)}
    attention = ops[ATTENTION][0]
    if full_layers_share:
        full = engine(model, system).decode_step_per_op(batch, full_length, 2)
        full_attention = next(ms for name, ms, _, _ in full if name == ATTENTION)
        attention = (1 - full_layers_share) * attention + full_layers_share * full_attention
    rest = sum(ms for name, (ms, _) in ops.items() if name != ATTENTION)
    measured = sum(ms for ms, source in ops.values() if source == "silicon")
    return {"kernels_ms": rest + attention, "attention_ms": attention, "other_ms": rest,
            "measured_share": measured / max(sum(ms for ms, _ in ops.values()), 1e-12), **versions(system)}


def policy_step(model: str, spec: Spec, work: Mapping, batch: int, kv_length: int, full_length: int | None = None,
                full_layers_share: float = 0.0, dtype: str = "bfloat16") -> dict:
    """A policy's decode step on `spec`'s GPU (ms): aiconfigurator's kernels at the attended length, the step's
    selection work (`work`'s select_read_bytes and select_flops, one step's counts) at the spec's roofline, its
    transfers over the link; serialized and overlapped."""
    if spec.kernel_system is None:
        raise UserError(f"{spec.name} has no measured kernel tables in aiconfigurator-core ({spec.kernel_source})")
    kernels = kernel_step(model, spec.kernel_system, batch, kv_length, full_length, full_layers_share)
    selection = {key: 0.0 for key in work} | {k: work[k] for k in ("select_read_bytes", "select_flops")}
    select = phase_times(selection, spec, dtype)
    select_ms = 1e3 * max(select["memory_s"], select["compute_s"])
    transfer_ms = 1e3 * transfer_time(work, spec)
    compute_ms = kernels["kernels_ms"] + select_ms
    return {**kernels, "select_ms": select_ms, "transfer_ms": transfer_ms,
            "step_serialized_ms": compute_ms + transfer_ms, "step_overlapped_ms": max(compute_ms, transfer_ms)}
