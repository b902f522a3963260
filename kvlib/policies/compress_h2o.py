"""Compress instead of preempt (issue 45): a serving runner that holds every entry, in blocks as `paged` does, until
its block pool runs low; then, where vLLM preempts a running request and recomputes it later (Kwon et al., 2023), it
compacts a running request's cache to `compress_share` of its entries by H2O's accumulated attention and goes on, as
kvpress's DecodingPress compresses a cache during decoding.

It is kvlib's own hybrid; no official code does this. Its rules come from two sources (its `fidelity` entry):
- kvpress's DecodingPress (`decoding_press.py`) compresses a cache to its `target_size` and never below it (a cache
  at or under the target is left alone). Here the target is a floor: a request is never compressed below its budget,
  `budget` of its prompt's tokens per KV head as every budgeted policy counts them (`tokens_allowed`; the prompt as
  its last prefill saw it, so a request recomputed after a preemption counts what it had generated too). A request
  is compressed to max(floor, `compress_share` of what it holds); one at its floor is not compressed.
- vLLM's scheduler (`vllm/v1/core/sched/scheduler.py`) preempts the newest running request when a running one finds
  no free block, and lets a waiting request wait when it finds none. Here running requests are compressed so that
  they can continue, in place of that preemption; a waiting request still waits for room, as in vLLM, unless
  `compress_to_admit` says to compress a running request to let it in (what kvlib did before issue 53). When every
  running request is at its floor, it preempts as `paged` does.

It serves under the scheduler's `compress` schedule (kvlib.engine.scheduler, `serving_schedule`), which compacts the
least compressed, then longest-running, request (`compress`) whenever a decode step finds no free block. The run lists
which requests were compressed, at which step and time, and from how many entries to how many (`compressions` in its
stats), so that the accuracy lost is attributed to those requests: the others decode as they do under `paged`
(greedy: the same tokens; tests/policies/test_compress_h2o.py, and the serving report reads it from every run).

Before the pool runs low it holds what `paged` holds but does not run as `paged` does: its prefill is H2O's (chunked,
each chunk's attention matrix materialized for the scores), every decode step asks the kernel for the attention
probabilities, and each slot carries 12 bytes of score and position (kvlib.policies.scored_eviction). Its goodput
against `paged`'s therefore mixes that overhead with the effect of compressing instead of preempting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvlib.errors import UserError
from kvlib.policies.fidelity import Fidelity, Rule, Source
from kvlib.policies.h2o import HeavyHitterPolicy
from kvlib.policies.registry import register

KVPRESS = Source("NVIDIA/kvpress", "8bb29b9c3078452a86d692f29123fa6c793e2b05", "kvpress/presses/decoding_press.py")
VLLM_SCHEDULER = "vllm-project/vllm@00024d3 vllm/v1/core/sched/scheduler.py"


@register
@dataclass
class CompressH2OPolicy(HeavyHitterPolicy):
    """H2O that keeps everything until the pool runs low, then compresses running requests, never below their budget,
    instead of preempting them."""

    name = "compress_h2o"
    # budget 1.0 is its default: every entry until a serving pool runs low (tests/policies/test_compress_h2o.py)
    small_example: ClassVar[dict] = {}
    keeps_all_example: ClassVar[dict] = {}
    one_pass_source = ""  # a serving schedule's policy: no accuracy harness of its own
    serving_schedule: ClassVar[str] = "compress"
    adopts_prefill = True  # H2O's prefill, unchanged
    keeps = ("every entry until the block pool runs low, then compress_share of a running request's entries per KV "
             "head, never fewer than its budget of its prompt")
    evicts = ("when the block pool runs low, a running request's least accumulated attention outside a recent window "
              "(instead of preempting it), down to its budget at the least")

    budget: float = 0.3  # the floor: never compressed below this share of its prompt (the serving chapter's H2O budget)
    compress_share: float = 0.5  # the share of its entries a compressed request keeps (at least its floor)
    compress_to_admit: bool = False  # True: also compress a running request to let a waiting one in
    # its limits never read the prompt, and its floor counts the prompt of its last prefill: a compression leaves it
    compress_restarts_limits: ClassVar[bool] = False

    fidelity = Fidelity(KVPRESS, rules=(
        Rule("floor", "target_size, 2048 tokens: never below it", setting="budget",
             differs="budget x its prompt's tokens, as kvlib's budgeted policies count a budget"),
        Rule("when it compresses", "every 512 decode steps", kvlib="when a decode step finds no free block",
             differs="in place of vLLM's preemption, the hybrid's point"),
        Rule("what one compression keeps", "target_size at once", setting="compress_share",
             differs="a share of what it holds, down to its floor: each compression frees part of one cache"),
        Rule("whom it compresses", "every request (a batch-wide press)", kvlib="least compressed, then oldest",
             differs="one request at a time, where vLLM would preempt one"),
        Rule("compress to admit a waiting one (vLLM: it waits)", False, setting="compress_to_admit"),
        Rule("none can shrink (vLLM)", "preempt the newest running", kvlib="preempt the newest running"),
        Rule("scores (H2O)", "attention received, accumulated per KV head",
             kvlib="attention received, accumulated per KV head"),
        Rule("before the pool runs low (paged)", "fused prefill, no scores",
             kvlib="H2O's matrix prefill, probabilities each step, 12 B a slot",
             differs="the scores must be there when the pool runs low"),
    ), note="kvlib's own hybrid, with no official code of its own: the floor from kvpress's DecodingPress (the source), "
            f"the preemption and the waiting from vLLM's scheduler ({VLLM_SCHEDULER}), the scores and the recent "
            "window from H2O (as `h2o` has them). Until its pool runs low it holds what `paged` holds, but not as "
            "`paged` runs: its goodput against `paged` mixes that overhead with compressing instead of preempting.")

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.compress_share < 1:
            raise UserError(f"compress_share must be in (0, 1), got {self.compress_share}")

    def limits(self, seen: int, prompt: int) -> tuple[int, int]:
        """Every entry, whatever the budget (the floor of a compression, not a limit); the recent window, which a
        compression keeps, is H2O's share of them."""
        return seen, round(seen * self.recent_ratio)

    def floor(self, row: int) -> int:
        """The fewest entries per KV head a compression leaves the row: its budget of its prompt."""
        return self.tokens_allowed(int(self.tokens.prompt_of[row]))

    def compress(self, row: int, share: float) -> tuple[int, int]:
        """ScoredEvictionPolicy.compress to max(floor, share x held) entries; a row at its floor is left as it is.
        Returns (entries a head held, entries it keeps)."""
        held, floor = int(self.kept[row]), self.floor(row)
        if held <= floor:
            return held, held
        # round(floor / held x held) is the floor itself, and round(x) >= floor wherever x >= floor
        return super().compress(row, max(share, floor / held))
