"""A Session: a batch of cache rows open on a model and policy (an Engine's) between the policy's start and finish.

The scheduler's loop (kvlib.engine.scheduler: the paper's static schedule and continuous batching), the retention test
and lm-eval's model all drive policies through it, so every policy is timed by the same sections and booked in the
same ledger whoever drives it. Nothing else calls a policy's lifecycle.

A prefill can be shared across policies (kvlib.engine.prefill_record): `prefill(..., prefill_store=store)` takes a
PrefillStore, and a policy that adopts a recorded dense prefill gets its row's state from the store's record of that
prompt (recorded on a miss) instead of computing it; any other policy, or a row that already holds tokens, runs its
own prefill. Results are bit for bit those of a policy's own prefill.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

from kvlib.engine.prefill_record import PrefillStore, prefill_passes
from kvlib.memory.block_pool import PoolRoom
from kvlib.memory.ledger import MemoryLedger, NoLedger
from kvlib.memory.timing import NoTimers, Timers
from kvlib.models import LoadedModel
from kvlib.models.passes import RecordedPass, Step
from kvlib.policies.base import KVPolicy

T = TypeVar("T")


def activation_bytes(model: LoadedModel, batch: int, q_len: int) -> int:
    """Working set of one forward pass outside attention: residual, normed input, Q/K/V, MLP, last-token logits."""
    c, s = model.model.config, model.spec
    per_token = (2 * s.hidden_size + (s.num_attention_heads + 2 * s.num_kv_heads) * s.head_dim
                 + 3 * c.intermediate_size)
    return batch * q_len * per_token * s.dtype_bytes + batch * c.vocab_size * 4


class Session:
    """Rows of cache open on a model bound to a policy (kvlib.engine.Engine opens it), and the forward passes that
    fill them: prefill extends a row, decode advances several rows by one token, fork copies a row (a branch off a
    shared prefix), release empties one. Each row's length is tracked here, so callers never compute positions. It
    runs what it is asked and calls no one back: the scheduler's loop asks it (and its policy, `room`) before each
    pass."""

    def __init__(self, model: LoadedModel, policy: KVPolicy, ledger: MemoryLedger | NoLedger,
                 timers: Timers | NoTimers, prompt_lens: list[int], max_new_tokens: int,
                 pool_bytes: int | None = None):
        """pool_bytes: what a block-holding policy's pool gets when it serves under a device capacity
        (kvlib.memory.paged_kv.serving_pool_bytes); None: sized from these rows."""
        self.model, self.policy, self.ledger, self.timers = model, policy, ledger, timers
        self.lengths = [0] * len(prompt_lens)
        ledger.clear()
        self.timers.reset()
        self.closed = True  # until the policy has started: nothing to finish
        self.policy.open_session(len(prompt_lens), pool_bytes)
        with self.timers.section("allocate"):
            ledger.add("device", "weights", model.weights_bytes - self.policy.weights_off_device(),
                       where="model weights")
            ledger.add("device", "weights_packed", model.packed_copy_bytes, where="packed copies of weights")
            self.closed = False
            try:
                self.policy.start(len(prompt_lens), prompt_lens, max_new_tokens)
            except BaseException:
                self.close()  # whatever the policy allocated before the capacity ran out
                raise

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, step: Step) -> torch.Tensor | None:
        """Run the model on [B, T] new tokens of step.rows; return the last position's logits [B, V] (fp32), or None
        where the step's are not read (step.logits) and the model's forward skips them."""
        positions = step.start[:, None] + torch.arange(step.q_len)[None, :]

        def layers() -> torch.Tensor:
            with self.ledger.transient("device", "activations", activation_bytes(self.model, *input_ids.shape),
                                       f"{step.phase} forward"):
                return self.model.forward(input_ids, positions, step)
        logits = self.run_pass(step, "compute", layers)
        return None if logits is None else logits.float()

    def run_pass(self, step: Step, section: str, layers: Callable[[], T]) -> T:
        """One pass as every policy goes through it, computed (forward) or adopted from a recorded prefill (adopt):
        prepare, the layers, after_pass, timed as `section`, and counted as a forward pass."""
        with self.timers.section(section):
            self.policy.prepare(step)
            out = layers()
            self.policy.after_pass(step)
        self.policy.work.forward_pass(step.phase, len(step.rows), step.q_len, step.start)
        return out

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

    def prefill_chunk(self, row: int, tokens: list[int], mode: str, end: int, logits: bool = True,
                      step: Step | None = None) -> torch.Tensor | None:
        """Extend a row by tokens, one forward pass; `end` is the row's length once its whole prompt (this prefill)
        is in. Returns the logits after the last token [V] of the prompt's last chunk where `logits`, else None (the
        model's LM head not run). step: the pass as prefill_step makes it, where the caller made it already."""
        self.timers.phase = "prefill"
        step = step or self.prefill_step(row, len(tokens), mode, end, logits)
        out = self.forward(torch.tensor([tokens]), step)
        self.lengths[row] += len(tokens)
        return None if out is None else out[0]

    def prefill_step(self, row: int, new_tokens: int, mode: str, end: int, logits: bool = True) -> Step:
        """The pass that extends a row by its next new_tokens, towards `end` (its length once this prefill is in)."""
        start = self.lengths[row]
        last = start + new_tokens >= end
        return Step(self.policy, torch.tensor([row]), torch.tensor([start]), new_tokens, "prefill", mode,
                    last_chunk=last, end=torch.tensor([end]), logits=logits and last)

    def next_prefill(self, row: int, tokens: list[int], mode: str, chunk_size: int) -> list[int]:
        """The tokens of the row's next own prefill pass towards holding `tokens`: the next chunk, or the rest."""
        held = self.lengths[row]
        return tokens[held:held + (chunk_size if mode == "chunked" else len(tokens) - held)]

    def prefill_next(self, row: int, tokens: list[int], mode: str, chunk_size: int,
                     prefill_store: PrefillStore | None = None, step: Step | None = None) -> torch.Tensor:
        """One step of a row's prefill towards holding `tokens` (some of them perhaps in already): the whole prompt
        adopted from `prefill_store` where the policy adopts it into a fresh row (adopt), else its own pass over the
        next chunk (chunked mode) or the rest (`step`: that pass, where the caller made it to ask its room). Returns
        the logits after the pass's last token."""
        store = prefill_store if not self.lengths[row] else None
        logits = None if store is None else self.adopt(row, tokens, mode, chunk_size, store)
        if logits is None:
            logits = self.prefill_chunk(row, self.next_prefill(row, tokens, mode, chunk_size), mode, len(tokens),
                                        step=step)
        return logits

    def prefill(self, row: int, tokens: list[int], mode: str, chunk_size: int = 512,
                prefill_store: PrefillStore | None = None, logits: bool = True) -> torch.Tensor | None:
        """Extend a row by a whole prompt (or the next turn of a conversation), in chunks for `chunked` prefill.
        prefill_store: a PrefillStore whose record of this prompt the policy adopts where it can (adopt), else ignored.
        logits: False where the caller reads none (a conversation's turn, a strict prompt's head): None is
        returned, and a pass the row computes itself skips the LM head."""
        if prefill_store is not None:
            adopted = self.adopt(row, tokens, mode, chunk_size, prefill_store)
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
        the policy goes through the passes of its own prefill (run_pass: prepare, each layer's adopt_pass in
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
        record = store.get(self, tokens, arithmetic, passes)
        with torch.inference_mode():
            for index, (begin, length) in enumerate(passes):
                step = Step(self.policy, torch.tensor([row]), torch.tensor([begin]), length, "prefill", mode,
                            last_chunk=begin + length >= len(tokens), end=torch.tensor([len(tokens)]))
                self.run_pass(step, "adopt", functools.partial(self._adopt_layers, record.pass_of(index), step))
                self.lengths[row] = begin + length
        return record.logits

    def _adopt_layers(self, recorded: RecordedPass, step: Step) -> None:
        for layer in range(self.model.spec.num_layers):
            self.policy.adopt_pass(layer, recorded, step)

    def decode(self, rows: list[int], tokens: list[int], step: Step | None = None) -> torch.Tensor:
        """Row rows[i] is fed tokens[i] after what it holds (`step`: that pass, where the caller made it already);
        returns logits [B, V]."""
        self.timers.phase = "decode"
        logits = self.forward(torch.tensor(tokens)[:, None], step or self.decode_step(rows))
        for r in rows:
            self.lengths[r] += 1
        self.policy.usage.held(self.ledger.held("device"), sum(self.lengths))
        return logits

    def room(self, step: Step) -> PoolRoom | None:
        """What the pass would take from the policy's block pool, against what it has free (KVPolicy.pool_room, timed
        by the policy as its block management, in the pass's phase); None: the policy holds no pool."""
        self.timers.phase = step.phase
        return self.policy.pool_room(step)

    def decode_step(self, rows: list[int]) -> Step:
        """The pass that advances each of the rows by one token."""
        start = torch.tensor([self.lengths[r] for r in rows])
        return Step(self.policy, torch.tensor(rows), start, 1, "decode", end=start + 1)

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
