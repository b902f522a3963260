"""Compress instead of preempt (issue 45): a serving runner that holds every entry, in blocks as `paged` does, until
its block pool runs low; then, where vLLM preempts a running request and recomputes it later (Kwon et al., 2023), it
compacts a running request's cache to `compress_share` of its entries by H2O's accumulated attention and goes on, as
kvpress's DecodingPress compresses a cache during decoding.

It is H2O (kvlib.policies.h2o) at budget 1.0 that serves under the scheduler's `compress` schedule
(kvlib.engine.scheduler, `serving_schedule`), which compacts the least compressed, then longest-running, request
(`policy.compress`) whenever a decode step or a waiting request's prefill finds no free block, and preempts only when
no running request can shrink any more. The run lists which requests were compressed, at which step and time, and from
how many entries to how many (`compressions` in its stats), so that the accuracy lost is attributed to those requests:
the others decode as they do under `paged` (greedy: the same tokens; tests/test_compress_h2o.py, and the serving
report reads it from every run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvlib.errors import UserError
from kvlib.policies.h2o import HeavyHitterPolicy
from kvlib.policies.registry import register


@register
@dataclass
class CompressH2OPolicy(HeavyHitterPolicy):
    """H2O that keeps everything until the pool runs low, then compresses running requests instead of preempting."""

    name = "compress_h2o"
    serving_schedule: ClassVar[str] = "compress"
    adopts_prefill = True  # H2O's prefill, unchanged
    keeps = "every entry until the block pool runs low, then compress_share of a running request's entries per KV head"
    evicts = ("when the block pool runs low, a running request's least accumulated attention outside a recent window "
              "(instead of preempting it)")

    budget: float = 1.0  # everything, as paged keeps it, until the pool runs low
    compress_share: float = 0.5  # the share of its entries a compressed request keeps

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.compress_share < 1:
            raise UserError(f"compress_share must be in (0, 1), got {self.compress_share}")
