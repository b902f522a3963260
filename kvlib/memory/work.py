"""What each pass of a run reads, computes and moves, counted by the engine for every policy alike.

Three places count, whatever the policy: the engine, once per forward pass (the weights the pass multiplies by, its
linear layers' FLOPs, and a prefill's attention, dense and causal as every policy's prefill computes it); the one
decode attention every policy runs (kvlib.policies.base.KVPolicy.decode_attention: the KV the kernel actually attended,
codes and scales where they are codes, and the probabilities handed back where a policy scores); and the copies
between tiers (kvlib.memory.disk.Transfers for FlexGen's tiers, InfiniGen's fetch and its write-back). A policy adds
only what no shared code sees: its selection's metadata and arithmetic (InfiniGen's partial keys, Quest's bounds).

A crossing between tiers is counted where the policy's mechanism crosses them, whether or not this machine copies: on
a CPU host and device are one memory and InfiniGen reads its host tier in place, and the entries it selects are counted
as leaving the host tier all the same. What a crossing costs is the machine's (kvlib.projection: nothing where the
two tiers are one memory, whose reads are counted in kv_read_bytes; the link's time on a GPU).

The counts are the work a pass cannot avoid on any machine: kvlib.projection reads them against a machine's limits
(a bound on the pass's time). Each run's stats carry them per phase as `work_<phase>_<quantity>`.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch


class Shape(Protocol):
    """What the counter reads of a model's shape (kvlib.models.pass_shape.PassShape, a layer above this one)."""

    head_dim: int
    dtype_bytes: int

    def pass_work(self, rows: int, q_len: int) -> dict: ...
    def dense_prefill(self, start: int, q_len: int) -> dict: ...
    def attention_work(self, tokens_read: int, query_keys: int) -> dict: ...

PHASES = ("prefill", "decode")
QUANTITIES = (
    "passes",
    "weight_bytes",  # weights a pass multiplies by, each once (the LM head whole; the embedding table's looked-up rows)
    "kv_read_bytes",  # keys and values attention read (codes and their scales where a policy keeps codes)
    "select_read_bytes",  # selection metadata read: partial keys, block bounds, the probabilities a scorer folds
    "linear_flops",
    "attention_flops",
    "select_flops",
    "host_to_device_bytes", "host_to_device_transfers",
    "device_to_host_bytes", "device_to_host_transfers",
    "disk_to_host_bytes", "disk_to_host_transfers",
    "host_to_disk_bytes", "host_to_disk_transfers",
)
DIRECTIONS = ("host_to_device", "device_to_host", "disk_to_host", "host_to_disk")


class Work:
    """A session's counts, per phase (QUANTITIES above)."""

    def __init__(self, shape: Shape | None):
        self.shape = shape
        self.counts = {phase: dict.fromkeys(QUANTITIES, 0) for phase in PHASES}
        self.lock = threading.Lock()  # FlexGen's copy thread counts its transfers beside the engine's thread

    def add(self, phase: str, **amounts: int) -> None:
        counts = self.counts[phase]
        with self.lock:
            for key, value in amounts.items():
                counts[key] += int(value)

    def transfer(self, phase: str, direction: str, nbytes: int) -> None:
        """One copy between tiers (a direction of DIRECTIONS)."""
        self.add(phase, **{f"{direction}_bytes": nbytes, f"{direction}_transfers": 1})

    def forward_pass(self, phase: str, rows: int, q_len: int, start: torch.Tensor | None = None) -> None:
        """A forward pass of the model (the engine's, or an adopted prefill's: its work is its own prefill's); a
        prefill's attention counted dense and causal over each row's `start` cached tokens."""
        if self.shape is None:
            return
        self.add(phase, **self.shape.pass_work(rows, q_len))
        if phase == "prefill":
            for s in start.tolist():
                self.add(phase, **self.shape.dense_prefill(int(s), q_len))

    def decode_reads(self, phase: str, reads, group: int) -> None:
        """One layer's decode attention over what `reads` (kvlib.kernels.decode.DecodeReads) names."""
        if self.shape is None:
            return
        lengths = reads.per_head_lengths()
        tokens = int(lengths.sum())
        work = self.shape.attention_work(tokens, tokens * group)
        if reads.quantized is not None:
            work["kv_read_bytes"] = quantized_read_bytes(reads, lengths, self.shape.head_dim, self.shape.dtype_bytes)
        if reads.probs:
            work["select_read_bytes"] = tokens * 4  # fp32 probabilities summed per KV head, folded into scores
        self.add(phase, **work)

    def summary(self) -> dict:
        return {f"work_{phase}_{key}": value for phase, counts in self.counts.items() for key, value in counts.items()}


def quantized_read_bytes(reads, lengths: torch.Tensor, head_dim: int, dtype_bytes: int) -> int:
    """What a decode step reads of a cache whose oldest tokens are codes (kvlib.kernels.quantized): each coded token's
    key and value codes with its share of their scales and zero points, the rest at full precision."""
    q = reads.quantized
    coded_k = torch.minimum(q.keys_quantized[:, None], lengths).sum().item()
    coded_v = torch.minimum(q.values_quantized[:, None], lengths).sum().item()
    scale = q.key_scale.element_size()
    key_token = head_dim * q.bits / 8 + 2 * head_dim * scale / q.group
    value_token = head_dim * q.bits / 8 + 2 * q.value_scale.shape[-1] * scale
    dense = 2 * int(lengths.sum()) - coded_k - coded_v
    return int(coded_k * key_token + coded_v * value_token + dense * head_dim * dtype_bytes)
