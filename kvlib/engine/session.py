"""A Session: a batch of cache rows open on an engine between the policy's start and finish.

The scheduler's loop (kvlib.engine.scheduler: the paper's static schedule and continuous batching), the retention test
and lm-eval's model all drive policies through it, so every policy is timed by the same sections and booked in the
same ledger whoever drives it. Nothing else calls a policy's lifecycle.

A prefill can be shared across policies (kvlib.engine.prefill_record): `prefill(..., shared=store)` takes a
PrefillStore, and a policy that adopts a recorded dense prefill gets its row's state from the store's record of that
prompt (recorded on a miss) instead of computing it; any other policy, or a row that already holds tokens, runs its
own prefill. Results are bit for bit those of a policy's own prefill.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from kvlib.engine.prefill_record import PrefillStore, prefill_passes
from kvlib.memory.ledger import MemoryLedger, NoLedger
from kvlib.memory.paged_kv import serving_pool_bytes
from kvlib.memory.timing import NoTimers, Timers
from kvlib.models import LoadedModel
from kvlib.models.passes import RecordedPass, Step
from kvlib.policies.base import KVPolicy

T = TypeVar("T")


class EngineCore(Protocol):
    """What a session and the scheduler's loop use of their engine (kvlib.engine.engine.Engine, which opens sessions
    and runs the loop), named here so that neither imports the module that imports them."""

    model: LoadedModel
    policy: KVPolicy
    ledger: MemoryLedger | NoLedger
    timers: Timers | NoTimers
    capacity: int | None

    def forward(self, input_ids: torch.Tensor, step: Step) -> torch.Tensor: ...

    def run_pass(self, step: Step, section: str, layers: Callable[[], T]) -> T: ...

    def validate(self, prompts: list[list[int]], max_new_tokens: int, prefill_mode: str, chunk_size: int
                 ) -> None: ...

    def open(self, prompt_lens: list[int], max_new_tokens: int, serving: bool = False) -> Session: ...


class Session:
    """Rows of cache open on an engine: prefill extends a row, decode advances several rows by one token, fork copies
    a row (a branch off a shared prefix), release empties one. Each row's length is tracked here, so callers never
    compute positions."""

    def __init__(self, engine: EngineCore, prompt_lens: list[int], max_new_tokens: int, serving: bool = False):
        self.engine, self.policy, self.timers = engine, engine.policy, engine.timers
        model = engine.model
        self.lengths = [0] * len(prompt_lens)
        engine.ledger.clear()
        self.timers.reset()
        self.closed = True  # until the policy has started: nothing to finish
        # the engine's capacity, not its ledger's: a bare (uninstrumented) run sizes its pool as the booked run did
        self.policy.open_session(len(prompt_lens), serving_pool_bytes(
            engine.capacity, model.weights_bytes + model.packed_copy_bytes)
            if serving and engine.capacity is not None else None)
        with self.timers.section("allocate"):
            engine.ledger.add("device", "weights", model.weights_bytes - self.policy.weights_off_device(),
                              where="model weights")
            engine.ledger.add("device", "weights_packed", model.packed_copy_bytes, where="packed copies of weights")
            self.closed = False
            try:
                self.policy.start(len(prompt_lens), prompt_lens, max_new_tokens)
            except BaseException:
                self.close()  # whatever the policy allocated before the capacity ran out
                raise

    @property
    def rows(self) -> int:
        """The cache rows open: one a request, or fewer where a policy that reserves whole rows serves under a
        capacity (KVPolicy.rows)."""
        return self.policy.rows

    def prefix(self, row: int, prompt: list[int]) -> int:
        """Before a fresh row's prefill: how many leading prompt tokens the policy has cached already (prefix sharing),
        now in the row."""
        self.timers.phase = "prefill"
        with self.timers.section("block_management"):
            self.lengths[row] = self.policy.reuse_prefix(row, prompt)
        return self.lengths[row]

    def prefill_chunk(self, row: int, tokens: list[int], mode: str, end: int, logits: bool = True
                      ) -> torch.Tensor | None:
        """Extend a row by tokens, one forward pass; `end` is the row's length once its whole prompt (this prefill)
        is in. Returns the logits after the last token [V] of the prompt's last chunk where `logits`, else None (the
        model's LM head not run)."""
        self.timers.phase = "prefill"
        start = self.lengths[row]
        last = start + len(tokens) >= end
        step = Step(self.policy, torch.tensor([row]), torch.tensor([start]), len(tokens), "prefill", mode,
                    last_chunk=last, end=torch.tensor([end]), logits=logits and last)
        out = self.engine.forward(torch.tensor([tokens]), step)
        self.lengths[row] = start + len(tokens)
        return None if out is None else out[0]

    def prefill_next(self, row: int, tokens: list[int], mode: str, chunk_size: int,
                     shared: PrefillStore | None = None) -> torch.Tensor:
        """One step of a row's prefill towards holding `tokens` (some of them perhaps in already): the whole prompt
        adopted from `shared` where the policy adopts it into a fresh row (adopt), else its own pass over the next
        chunk (chunked mode) or the rest. Returns the logits after the pass's last token."""
        held = self.lengths[row]
        logits = self.adopt(row, tokens, mode, chunk_size, shared) if shared is not None and not held else None
        if logits is None:
            size = chunk_size if mode == "chunked" else len(tokens) - held
            logits = self.prefill_chunk(row, tokens[held:held + size], mode, len(tokens))
        return logits

    def prefill(self, row: int, tokens: list[int], mode: str, chunk_size: int = 512,
                shared: PrefillStore | None = None, logits: bool = True) -> torch.Tensor | None:
        """Extend a row by a whole prompt (or the next turn of a conversation), in chunks for `chunked` prefill.
        shared: a PrefillStore whose record of this prompt the policy adopts where it can (adopt), else ignored.
        logits: False where the caller reads none (a conversation's turn, a strict prompt's head): None is
        returned, and a pass the row computes itself skips the LM head."""
        if shared is not None:
            adopted = self.adopt(row, tokens, mode, chunk_size, shared)
            if adopted is not None:
                return adopted if logits else None
        end = self.lengths[row] + len(tokens)
        out = None
        for begin, length in prefill_passes(len(tokens), mode, chunk_size):
            out = self.prefill_chunk(row, tokens[begin:begin + length], mode, end, logits)
        return out

    def adopt(self, row: int, tokens: list[int], mode: str, chunk_size: int, store: PrefillStore
              ) -> torch.Tensor | None:
        """A fresh row's prefill taken from the store's record of this prompt (made by a recording pass on a miss):
        the policy goes through the passes of its own prefill (Engine.run_pass: prepare, each layer's adopt_pass in
        place of attend, after_pass), storing the recorded keys, values and statistics by the code its prefill runs.
        Returns the logits after the last token, or None, having done nothing, where the policy runs its own prefill
        (it adopts none in this mode, it reads more of the prompt's last queries than the store keeps, or the row
        holds tokens already)."""
        if self.lengths[row] or not tokens:
            return None
        passes = prefill_passes(len(tokens), mode, chunk_size)
        arithmetic = self.policy.prefill_arithmetic(mode, len(passes))
        if arithmetic is None or self.policy.prefill_queries() > store.query_window:
            store.own += 1
            return None
        self.timers.phase = "prefill"
        record = store.get(self.engine, tokens, arithmetic, passes)
        with torch.inference_mode():
            for index, (begin, length) in enumerate(passes):
                step = Step(self.policy, torch.tensor([row]), torch.tensor([begin]), length, "prefill", mode,
                            last_chunk=begin + length >= len(tokens), end=torch.tensor([len(tokens)]))
                self.engine.run_pass(step, "adopt", functools.partial(self._adopt_layers, record.pass_of(index), step))
                self.lengths[row] = begin + length
        return record.logits

    def _adopt_layers(self, recorded: RecordedPass, step: Step) -> None:
        for layer in range(self.engine.model.spec.num_layers):
            self.policy.adopt_pass(layer, recorded, step)

    def decode(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        """Row rows[i] is fed tokens[i] after what it holds; returns logits [B, V]."""
        self.timers.phase = "decode"
        start = torch.tensor([self.lengths[r] for r in rows])
        logits = self.engine.forward(torch.tensor(tokens)[:, None],
                                     Step(self.policy, torch.tensor(rows), start, 1, "decode", end=start + 1))
        for r in rows:
            self.lengths[r] += 1
        self.policy.usage.held(self.engine.ledger.held("device"), sum(self.lengths))
        return logits

    def fork(self, src: int, dst: int) -> None:
        with self.timers.section("fork"):
            self.policy.fork(src, dst)
        self.lengths[dst] = self.lengths[src]

    def release(self, row: int) -> None:
        with self.timers.section("block_management"):
            self.policy.release(row)
        self.lengths[row] = 0

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.policy.finish()
