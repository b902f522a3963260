"""One engine for every policy: the forward pass, and the Session through which everything drives a policy.

A Session is a batch of cache rows open on the engine between the policy's start and finish. The scheduler's loop
(kvlib.engine.scheduler: the paper's static schedule and continuous batching), the retention test and lm-eval's model all
drive policies through it, so every policy is timed by the same sections and booked in the same ledger whoever drives
it. Nothing else calls a policy's lifecycle.

A prefill can be shared across policies (kvlib.engine.prefill_record): `Session.prefill(..., shared=store)` and
`Engine.generate(..., prefill_store=store)` take a PrefillStore, and a policy that adopts a recorded dense prefill gets
its row's state from the store's record of that prompt (recorded on a miss) instead of computing it; any other policy,
or a row that already holds tokens, runs its own prefill. Results are bit for bit those of a policy's own prefill.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from kvlib.engine.prefill_record import PrefillStore, prefill_passes
from kvlib.engine.run_result import RunResult
from kvlib.errors import UserError
from kvlib.memory.ledger import MemoryLedger, NoLedger
from kvlib.memory.paged_kv import serving_pool_bytes
from kvlib.memory.timing import NoTimers, Timers
from kvlib.memory.work import Work
from kvlib.models import LoadedModel
from kvlib.models.workloads import calibration_prompt
from kvlib.policies.base import PREFILL_MODES, KVPolicy, KVUsage, Step


def activation_bytes(model: LoadedModel, batch: int, q_len: int) -> int:
    """Working set of one forward pass outside attention: residual, normed input, Q/K/V, MLP, last-token logits."""
    c, s = model.model.config, model.spec
    per_token = (2 * s.hidden_size + (s.num_attention_heads + 2 * s.num_kv_heads) * s.head_dim
                 + 3 * c.intermediate_size)
    return batch * q_len * per_token * s.dtype_bytes + batch * c.vocab_size * 4


class Engine:
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
    def forward(self, input_ids: torch.Tensor, step: Step) -> torch.Tensor:
        """Run the model on [B, T] new tokens of step.rows; return the last position's logits [B, V] (fp32)."""
        positions = step.start[:, None] + torch.arange(step.q_len)[None, :]
        with self.timers.section("compute"):
            self.policy.prepare(step)
            with self.ledger.transient("device", "activations", activation_bytes(self.model, *input_ids.shape),
                                       f"{step.phase} forward"):
                logits = self.model.forward(input_ids, positions, step)
            self.policy.after_pass(step)
        self.policy.work.forward_pass(step.phase, len(step.rows), step.q_len, step.start)
        return logits.float()

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
        from kvlib.engine.scheduler import Sequence, run

        if forced is not None:
            if len(forced) != len(prompts) or not all(forced):
                raise UserError("forced needs one non-empty continuation per prompt")
            max_new_tokens = max(map(len, forced))
        sequences = [Sequence(p, len(forced[i]) if forced else max_new_tokens, forced=forced[i] if forced else None)
                     for i, p in enumerate(prompts)]
        return run(self, sequences, "static", prefill_mode, chunk_size, stop_at_eos=stop_at_eos,
                   share_prompts=share_prompts, prefill_store=prefill_store)


class Session:
    """Rows of cache open on an engine: prefill extends a row, decode advances several rows by one token, fork copies
    a row (a branch off a shared prefix), release empties one. Each row's length is tracked here, so callers never
    compute positions."""

    def __init__(self, engine: Engine, prompt_lens: list[int], max_new_tokens: int, serving: bool = False):
        self.engine, self.policy, self.timers = engine, engine.policy, engine.timers
        model = engine.model
        # the engine's capacity, not its ledger's: a bare (uninstrumented) run sizes its pool as the booked run did
        self.policy.serving_bytes = serving_pool_bytes(engine.capacity, model.weights_bytes + model.packed_copy_bytes) \
            if serving and engine.capacity is not None else None
        self.lengths = [0] * len(prompt_lens)
        engine.ledger.clear()
        self.timers.reset()
        self.closed = True  # until the policy has started: nothing to finish
        self.policy.usage = KVUsage(engine.model.spec.num_layers)
        self.policy.work = Work(engine.model.pass_shape)
        with self.timers.section("allocate"):
            engine.ledger.add("device", "weights", engine.model.weights_bytes - self.policy.weights_off_device(),
                              where="model weights")
            engine.ledger.add("device", "weights_packed", engine.model.packed_copy_bytes,
                              where="packed copies of weights")
            self.closed = False
            self.policy.rows = len(prompt_lens)
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

    def prefill_chunk(self, row: int, tokens: list[int], mode: str, end: int) -> torch.Tensor:
        """Extend a row by tokens, one forward pass; `end` is the row's length once its whole prompt (this prefill)
        is in. Returns the logits after the last token [V]."""
        self.timers.phase = "prefill"
        start = self.lengths[row]
        step = Step(self.policy, torch.tensor([row]), torch.tensor([start]), len(tokens), "prefill", mode,
                    last_chunk=start + len(tokens) >= end, end=torch.tensor([end]))
        logits = self.engine.forward(torch.tensor([tokens]), step)
        self.lengths[row] = start + len(tokens)
        return logits[0]

    def prefill(self, row: int, tokens: list[int], mode: str, chunk_size: int = 512,
                shared: PrefillStore | None = None) -> torch.Tensor:
        """Extend a row by a whole prompt (or the next turn of a conversation), in chunks for `chunked` prefill.
        shared: a PrefillStore whose record of this prompt the policy adopts where it can (adopt), else ignored."""
        if shared is not None:
            logits = self.adopt(row, tokens, mode, chunk_size, shared)
            if logits is not None:
                return logits
        end = self.lengths[row] + len(tokens)
        logits = None
        for begin, length in prefill_passes(len(tokens), mode, chunk_size):
            logits = self.prefill_chunk(row, tokens[begin:begin + length], mode, end)
        return logits

    def adopt(self, row: int, tokens: list[int], mode: str, chunk_size: int, store: PrefillStore
              ) -> torch.Tensor | None:
        """A fresh row's prefill taken from the store's record of this prompt (made by a recording pass on a miss):
        the policy goes through the same passes as its own prefill (prepare, each layer's adopt_pass, after_pass),
        storing the recorded keys, values and statistics by the code its prefill runs. Returns the logits after the
        last token, or None, having done nothing, where the policy runs its own prefill (it adopts none in this
        mode, it reads more of the prompt's last queries than the store keeps, or the row holds tokens already)."""
        if self.lengths[row] or not tokens:
            return None
        passes = prefill_passes(len(tokens), mode, chunk_size)
        arithmetic = self.policy.prefill_arithmetic(mode, len(passes))
        if arithmetic is None or self.policy.prefill_queries() > store.query_window:
            store.own += 1
            return None
        self.timers.phase = "prefill"
        record = store.get(self.engine, tokens, arithmetic, passes)
        layers = self.engine.model.spec.num_layers
        with torch.inference_mode():
            for index, (begin, length) in enumerate(passes):
                step = Step(self.policy, torch.tensor([row]), torch.tensor([begin]), length, "prefill", mode,
                            last_chunk=begin + length >= len(tokens), end=torch.tensor([len(tokens)]))
                recorded = record.pass_of(index)
                with self.timers.section("adopt"):
                    self.policy.prepare(step)
                    for layer in range(layers):
                        self.policy.adopt_pass(layer, recorded, step)
                    self.policy.after_pass(step)
                self.policy.work.forward_pass("prefill", 1, length, step.start)  # its own prefill's work
                self.lengths[row] = begin + length
        return record.logits

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
