"""One engine for every policy: the forward pass, and the sessions (kvlib.engine.session) through which everything
drives a policy; `generate` runs the scheduler's loop (kvlib.engine.scheduler), which drives the engine it is given.

A prefill can be shared across policies (kvlib.engine.prefill_record): `Session.prefill(..., shared=store)` and
`Engine.generate(..., prefill_store=store)` take a PrefillStore, and a policy that adopts a recorded dense prefill gets
its row's state from the store's record of that prompt (recorded on a miss) instead of computing it; any other policy,
or a row that already holds tokens, runs its own prefill. Results are bit for bit those of a policy's own prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import TypeVar

import torch

from kvlib.engine.prefill_record import PrefillStore
from kvlib.engine.run_result import RunResult
from kvlib.engine.scheduler import Sequence, run
from kvlib.engine.session import Session
from kvlib.errors import UserError
from kvlib.memory.ledger import MemoryLedger, NoLedger
from kvlib.memory.timing import NoTimers, Timers
from kvlib.models import LoadedModel
from kvlib.models.passes import Step
from kvlib.models.workloads import calibration_prompt
from kvlib.policies.base import PREFILL_MODES, KVPolicy

T = TypeVar("T")


def activation_bytes(model: LoadedModel, batch: int, q_len: int) -> int:
    """Working set of one forward pass outside attention: residual, normed input, Q/K/V, MLP, last-token logits."""
    c, s = model.model.config, model.spec
    per_token = (2 * s.hidden_size + (s.num_attention_heads + 2 * s.num_kv_heads) * s.head_dim
                 + 3 * c.intermediate_size)
    return batch * q_len * per_token * s.dtype_bytes + batch * c.vocab_size * 4


class Engine:
    """A model and a policy bound together: the engine owns the forward pass (forward, run_pass) and opens the
    sessions that drive it; the scheduler's loop drives a session, never the engine's internals."""

    def __init__(self, model: LoadedModel, policy: KVPolicy, device_capacity_bytes: int | None = None,
                 calibration: list[int] | None = None, instrumented: bool = True):
        """calibration: token ids a policy that calibrates offline (InfiniGen) learns from; the caller's choice
        (kvlib.models.workloads.calibration_prompt when not given). instrumented=False: no timer sections and no
        ledger (nothing booked, no capacity checked), for a run timed from outside only, as a timed vLLM run reads
        nothing from inside vLLM."""
        if device_capacity_bytes is not None and device_capacity_bytes <= 0:
            raise UserError(f"the device capacity must be positive, got {device_capacity_bytes} bytes")
        self.model, self.policy, self.capacity = model, policy, device_capacity_bytes
        self.ledger = MemoryLedger(device_capacity_bytes) if instrumented else NoLedger()
        self.timers = Timers(model.device) if instrumented else NoTimers(model.device)
        policy.bind(model, self.ledger, self.timers)
        if policy.calibrates:
            policy.calibrate(calibration if calibration is not None else calibration_prompt(model))

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
        """One pass as every policy goes through it, computed (forward) or adopted from a recorded prefill
        (Session.adopt): prepare, the layers, after_pass, timed as `section`, and counted as a forward pass."""
        with self.timers.section(section):
            self.policy.prepare(step)
            out = layers()
            self.policy.after_pass(step)
        self.policy.work.forward_pass(step.phase, len(step.rows), step.q_len, step.start)
        return out

    def validate(self, prompts, max_new_tokens, prefill_mode, chunk_size):
        """One clear error for a request this engine cannot run."""
        if not prompts:
            raise UserError("no prompts given")
        if max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if prefill_mode not in PREFILL_MODES:
            raise UserError(f"unknown prefill mode {prefill_mode!r}; choose from {list(PREFILL_MODES)}")
        if prefill_mode == "chunked" and chunk_size < 1:
            raise UserError(f"chunk_size must be >= 1, got {chunk_size}")
        self.policy.check_prefill(prefill_mode)
        limit = self.model.spec.max_context
        for i, p in enumerate(prompts):
            if not p:
                raise UserError(f"prompt {i} is empty")
            if len(p) + max_new_tokens > limit:
                raise UserError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} that exceeds "
                                f"the model's context of {limit} tokens")

    def open(self, prompt_lens: list[int], max_new_tokens: int, serving: bool = False) -> Session:
        """A new session of len(prompt_lens) rows (the ledger and timers start afresh). May raise DeviceOOM: the
        weights, or the policy's allocation, do not fit the device capacity. serving (continuous batching): a
        policy that holds a block pool sizes it from the device capacity, as vLLM does (serving_pool_bytes), not
        from these requests, so requests queue and are preempted when its blocks run out."""
        return Session(self, prompt_lens, max_new_tokens, serving)

    @contextmanager
    def session(self, prompt_lens: list[int], max_new_tokens: int):
        session = self.open(prompt_lens, max_new_tokens)
        try:
            yield session
        finally:
            session.close()

    def generate(self, prompts: list[list[int]], max_new_tokens: int, prefill_mode: str = "fused",
                 chunk_size: int = 512, stop_at_eos: bool = True, forced: list[list[int]] | None = None,
                 share_prompts: bool = False, prefill_store: PrefillStore | None = None) -> RunResult:
        """The paper's schedule: prefill each prompt in turn, then decode the batch together (greedy). With `forced`,
        teacher forcing: row r is fed forced[r] instead of its own choices, and each output carries the
        log-probabilities of those tokens (`logprobs`) and whether each was the greedy choice (`greedy`), while the
        policy keeps, evicts and fetches exactly as when generating. With share_prompts, a prompt equal to an earlier
        row's is not prefilled again: the policy forks that row (the answer choices of one question). With a
        prefill_store, each prompt's prefill is adopted from the store's record where the policy adopts one
        (Session.prefill), the same outputs as its own prefill."""
        if forced is not None:
            if len(forced) != len(prompts) or not all(forced):
                raise UserError("forced needs one non-empty continuation per prompt")
            max_new_tokens = max(map(len, forced))
        sequences = [Sequence(p, len(forced[i]) if forced else max_new_tokens, forced=forced[i] if forced else None)
                     for i, p in enumerate(prompts)]
        return run(self, sequences, "static", prefill_mode, chunk_size, stop_at_eos=stop_at_eos,
                   share_prompts=share_prompts, prefill_store=prefill_store)
