"""One engine for every policy: a model and a policy bound together, the sessions (kvlib.engine.session) that run
their forward passes, and the one entry point that serves requests (`run`: the scheduler's loop, kvlib.engine.scheduler,
over a session; `generate` is its static batch of prompts).

A prefill can be shared across policies (kvlib.engine.prefill_record): `Session.prefill(..., prefill_store=store)` and
`Engine.generate(..., prefill_store=store)` take a PrefillStore, and a policy that adopts a recorded dense prefill gets
its row's state from the store's record of that prompt (recorded on a miss) instead of computing it; any other policy,
or a row that already holds tokens, runs its own prefill. Results are bit for bit those of a policy's own prefill.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from kvlib.engine.prefill_record import PrefillStore
from kvlib.engine.run_result import RunResult, TokenClock, build_metrics, decoded_outputs, latency_metrics, oom_record
from kvlib.engine.scheduler import BATCHING, RunSettings, Scheduler, Sequence, resolve
from kvlib.engine.session import Session, activation_bytes
from kvlib.errors import DeviceOOM, UserError
from kvlib.memory.ledger import MemoryLedger, NoLedger
from kvlib.memory.paged_kv import serving_pool_bytes
from kvlib.memory.timing import NoTimers, Timers
from kvlib.models import LoadedModel
from kvlib.models.workloads import calibration_prompt
from kvlib.policies.base import PREFILL_MODES, KVPolicy

__all__ = ["Engine", "RunSettings", "Sequence", "activation_bytes"]


class Engine:
    """A model and a policy bound together, with the ledger and timers every run of them books in: the engine opens
    the sessions that run their forward passes (kvlib.engine.session) and serves requests through the scheduler's
    loop over one (`run`). Nothing it hands out calls it back."""

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
        # the engine's capacity, not its ledger's: a bare (uninstrumented) run sizes its pool as the booked run did
        pool_bytes = (serving_pool_bytes(self.capacity, self.model.weights_bytes + self.model.packed_copy_bytes)
                      if serving and self.capacity is not None else None)
        return Session(self.model, self.policy, self.ledger, self.timers, prompt_lens, max_new_tokens, pool_bytes)

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
        return self.run(sequences, RunSettings("static", prefill_mode, chunk_size, stop_at_eos=stop_at_eos,
                                               share_prompts=share_prompts, prefill_store=prefill_store))

    def run(self, sequences: list[Sequence], settings: RunSettings | None = None) -> RunResult:
        """Serve the requests under the settings' schedule (kvlib.engine.scheduler): each request's output, the
        clock's metrics, what the ledger booked; `oom` where the device ran out (the static schedule)."""
        settings = settings or RunSettings()
        schedule = resolve(settings, self.policy, self.model.tokenizer.eos_token_id)
        for seq in sequences:
            self.validate([seq.prompt], seq.max_new_tokens, settings.prefill_mode, settings.chunk_size)
        for index, seq in enumerate(sequences):
            seq.index, seq.row, seq.compressions = index, -1, 0
            if seq.forced is not None:
                seq.max_new_tokens, schedule = len(seq.forced), schedule.without_eos()
        try:
            session = self.open([len(s.prompt) for s in sequences], max(s.max_new_tokens for s in sequences),
                                serving=schedule.serving)
        except (DeviceOOM, torch.OutOfMemoryError) as exc:
            return self._result(sequences, TokenClock(len(sequences)), 0, settings.slo, oom_record(exc, "setup"))
        setup_s = self.timers.seconds.get("setup.allocate")
        try:
            scheduler = Scheduler(session, sequences, schedule)
            oom = scheduler.serve()
            p = self.policy
            memory, stats = self.ledger.snapshot(), {**p.stats(), **p.traits(), "batching": BATCHING[schedule.name],
                                                     **p.usage.summary(), **p.work.summary(),
                                                     "decode_attention": p.decode_kernel}
            if schedule.compress_share is not None:
                stats.update(compress_share=schedule.compress_share, compressions=scheduler.compressions)
        finally:
            session.close()
        return self._result(sequences, scheduler.clock, scheduler.preemptions, settings.slo, oom, memory, stats,
                            setup_s)

    def _result(self, sequences: list[Sequence], clock: TokenClock, preemptions: int, slo: dict | None,
                oom: dict | None, memory: dict | None = None, stats: dict | None = None,
                setup_s: float | None = None) -> RunResult:
        outputs = decoded_outputs(self.model.tokenizer, [s.generated for s in sequences], [s.prompt for s in sequences])
        if any(s.forced is not None for s in sequences):
            for out, seq in zip(outputs, sequences):
                out.update(logprobs=seq.logprobs, greedy=seq.greedy)
        slo = slo or {}
        metrics = build_metrics(
            **clock.metrics(), sections=dict(self.timers.seconds), setup_s=setup_s, completed=oom is None,
            preemptions=preemptions, **latency_metrics(clock, slo.get("ttft_s"), slo.get("tpot_s")))
        return RunResult(outputs=outputs, metrics=metrics, memory=memory or self.ledger.snapshot(),
                         policy={"name": self.policy.name, **self.policy.settings()}, oom=oom, stats=stats or {})
