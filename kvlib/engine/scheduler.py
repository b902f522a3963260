"""The one loop that serves requests on the engine, under one of three schedules.

`static` is the paper's schedule for H2O and InfiniGen, applied to every policy: each prompt is prefilled in turn (whole,
or chunk by chunk), then all requests decode together; finished rows stay allocated until the run ends; running out of
device memory ends the run as a recorded OOM point.

`continuous` is vLLM's: requests arrive at given decode steps, or at given times (a request rate: an open loop,
kvlib.engine.arrivals, each request joining when the clock passes its arrival); each iteration prefills one chunk of the oldest waiting
request (under `chunked` prefill; its whole prompt under `full` or `fused`, as vLLM without chunked prefill) and then
runs one decode step for every running request; finished requests leave and free their rows at once.
Every registered policy serves so. A policy that holds its cache in blocks (paged, Quest, H2O, StreamingLLM, SnapKV:
kvlib.memory.paged_kv) sizes its pool from the device capacity, as vLLM does; when the pool runs out, the newest
running request is preempted (its blocks freed, queued again, recomputed from its prompt and the tokens it had
generated, under its policy). A policy that reserves each row's whole length up front (full, KIVI, InfiniGen) holds
as many rows as the capacity affords, and a request waits for a free row (KVPolicy.row_capacity). It needs a policy
that can release single rows.

`compress` is `continuous` with another answer to a full pool: where vLLM preempts a running request because a decode
step finds no free block, a running request (the least compressed so far, then the longest-running) is compacted to
`compress_share` of its cache, chosen by its policy's scores (a scored-eviction policy: H2O's accumulated attention,
SnapKV's votes; compress_h2o holds everything, as `paged` does, until then, and is never compressed below its budget
of its prompt), its freed blocks let the step go on, and it goes on decoding from what it kept (a request may be
compressed again, the least compressed first). Only when no running request can shrink any more does it preempt, as
vLLM does. Compression lets running requests continue; a waiting request finding no room waits, as in vLLM, unless
the policy's `compress_to_admit` says to compress a running request to let it in, and after a compression, as after a
preemption, waiting requests are admitted once a running one has left (the blocks freed are the running ones' room).
Which requests were compressed, at which step and time, and from how many entries a head to how many, is in the
run's stats (`compressions`), so that the accuracy they lost can be told apart. A policy declares the schedule it
serves under (`serving_schedule`: `compress` for compress_h2o, kvlib.policies.compress_h2o, whose `compress_share`
is the share used unless one is passed; `continuous` for every other), which the serving experiment replays it under.

All go through the same Session (kvlib.engine), so they are timed and booked alike; only the order of work differs.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvlib.engine.run_result import RunResult, TokenClock, build_metrics, decoded_outputs, latency_metrics, oom_record
from kvlib.errors import DeviceOOM, UserError
from kvlib.memory.block_pool import OutOfBlocks

if TYPE_CHECKING:  # the engine calls this loop; the loop only drives the engine it is given
    from kvlib.engine.engine import Engine

SCHEDULES = ("static", "continuous", "compress")
# each schedule in the poster's words (its "batching" row), recorded with every run (kvlib.report.systems); short,
# since they are a table's column (the module's docstring says what each does)
BATCHING = {"static": "static", "continuous": "continuous, preempts when full",
            "compress": "continuous, compresses then preempts when full"}


@dataclass
class Sequence:
    """One request: its prompt, what it generated, and where it stands."""

    prompt: list[int]
    max_new_tokens: int
    arrival_step: int = 0
    arrival_s: float | None = None  # or when it arrives, in seconds from the start of the run (continuous schedule)
    forced: list[int] | None = None  # teacher forcing: the tokens fed instead of the model's own choices
    index: int = -1  # its place among the run's requests (outputs, the token clock)
    row: int = -1  # the cache row it holds while admitted (-1: none)
    status: str = "pending"  # pending -> waiting -> prefilling -> running -> finished
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    greedy: list[bool] = field(default_factory=list)

    def tokens_to_prefill(self) -> list[int]:
        """The prompt; after a preemption, also what it had generated but the last token (fed by the next decode)."""
        return self.prompt + self.generated[:-1]

    def take(self, logits: torch.Tensor) -> None:
        best = int(logits.argmax())
        token = self.forced[len(self.generated)] if self.forced is not None else best
        if self.forced is not None:
            self.logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
            self.greedy.append(token == best)
        self.generated.append(token)

    def done(self, eos: int | None) -> bool:
        return len(self.generated) >= self.max_new_tokens or (eos is not None and self.generated[-1] == eos)


def run(engine: Engine, sequences: list[Sequence], schedule: str = "static", prefill_mode: str = "fused",
        chunk_size: int = 512, stop_at_eos: bool = True, share_prompts: bool = False,
        slo: dict | None = None, compress_share: float | None = None, prefill_store=None) -> RunResult:
    """slo: {"ttft_s": ..., "tpot_s": ...}, the limits goodput counts against (kvlib.engine.run_result.latency_metrics).
    compress_share: under the `compress` schedule, the share of its entries a compressed request keeps; None: the
    policy's own `compress_share` where it has one (compress_h2o), else 0.5.
    prefill_store (static schedule): a PrefillStore whose records the policy adopts (Session.adopt)."""
    if schedule not in SCHEDULES:
        raise UserError(f"unknown schedule {schedule!r}; choose from {list(SCHEDULES)}")
    continuous = schedule in ("continuous", "compress")
    if schedule == "compress":
        if compress_share is None:
            compress_share = getattr(engine.policy, "compress_share", 0.5)
        if not hasattr(engine.policy, "compress"):
            raise UserError(f"the compress schedule needs a policy that compacts a running request's cache by its "
                            f"scores (h2o, snapkv); {engine.policy.name!r} cannot")
        if not 0 < compress_share < 1:
            raise UserError(f"compress_share must be in (0, 1), got {compress_share}")
    if continuous:
        if not engine.policy.can_release:
            raise UserError(f"continuous batching needs a policy that can release single rows; "
                            f"{engine.policy.name!r} cannot")
        if prefill_store is not None:
            raise ValueError("a prefill store serves the static schedule: continuous batching interleaves a prompt's "
                             "chunks with decode steps, and an adopted prefill would take them all at once")
    for seq in sequences:
        engine.validate([seq.prompt], seq.max_new_tokens, prefill_mode, chunk_size)
    eos = engine.model.tokenizer.eos_token_id if stop_at_eos else None
    for index, seq in enumerate(sequences):
        seq.index, seq.row = index, -1
        if seq.forced is not None:
            seq.max_new_tokens, eos = len(seq.forced), None
    timers = engine.timers
    loop = _Loop(engine, sequences, continuous, prefill_mode, chunk_size, eos, share_prompts, slo or {},
                 compress_share if schedule == "compress" else None, prefill_store)
    try:
        session = engine.open([len(s.prompt) for s in sequences], max(s.max_new_tokens for s in sequences),
                              serving=continuous)
    except (DeviceOOM, torch.OutOfMemoryError) as exc:
        return loop.result(oom_record(exc, "setup"))
    setup_s = timers.seconds.get("setup.allocate")
    try:
        oom = loop.serve(session)
        memory, stats = engine.ledger.snapshot(), {**engine.policy.stats(), **engine.policy.traits(),
                                                 "batching": BATCHING[schedule], **engine.policy.usage.summary(),
                                                 **engine.policy.work.summary(), "decode_attention": engine.policy.decode_kernel}
        if schedule == "compress":
            stats.update(compress_share=loop.compress_share, compressions=loop.compressions)
    finally:
        session.close()
    return loop.result(oom, memory, stats, setup_s)


class _Loop:
    """The state of one run: queues, clocks and counters."""

    def __init__(self, engine, sequences, continuous, prefill_mode, chunk_size, eos, share_prompts, slo,
                 compress_share=None, prefill_store=None):
        self.engine, self.seqs, self.continuous, self.slo = engine, sequences, continuous, slo
        self.store = prefill_store
        self.mode, self.chunk_size, self.eos, self.share = prefill_mode, chunk_size, eos, share_prompts
        self.clock = TokenClock(len(sequences))  # restarted when serving starts
        self.preemptions = 0
        self.compress_share = compress_share  # the compress schedule's; None: preempt as vLLM does
        # the compress schedule compacts running requests so that they continue, not to admit a waiting one
        self.compress_to_admit = getattr(engine.policy, "compress_to_admit", False)
        self.compressions: list[dict] = []

    def serve(self, session) -> dict | None:
        """Run until every sequence has finished; returns an OOM record if the device ran out (static schedule)."""
        settle = self.engine.timers.now  # on CUDA the step's one synchronization, and its sections read
        pending = deque(sorted(self.seqs, key=lambda s: (s.arrival_s or 0.0, s.arrival_step)))
        waiting: deque[Sequence] = deque()
        running: list[Sequence] = []
        prefilling: Sequence | None = None
        self.first_of: dict[tuple, tuple[Sequence, torch.Tensor]] = {}  # prompt -> its first request and logits
        blocked = False  # a prefill found no room: admit again once a running request has left
        # the cache rows the policy holds, handed to requests as they are admitted: every request's own row under the
        # static schedule; under the continuous one a policy that reserves a whole row up front (full, KIVI,
        # InfiniGen) holds as many as its capacity affords, and a request waits for one to be free
        free_rows = deque(range(session.rows))
        step = 0
        self.clock = TokenClock(len(self.seqs))
        while pending or waiting or running or prefilling:
            if pending and not (waiting or running or prefilling) and pending[0].arrival_s is not None:
                time.sleep(max(pending[0].arrival_s - self.clock.now(), 0.0))  # idle until the next request comes
            while pending and pending[0].arrival_step <= step and (pending[0].arrival_s or 0.0) <= self.clock.now():
                seq = pending.popleft()
                self.clock.arrive(seq.index, at=seq.arrival_s)
                seq.status = "waiting"
                waiting.append(seq)
            if prefilling is None and waiting and free_rows and (not blocked or not running):
                seq = waiting.popleft()
                seq.row = free_rows.popleft()
                shared = self.first_of.get(tuple(seq.prompt)) if self.share and not seq.generated else None
                if shared is not None:  # the same context as an earlier row: fork it instead of prefilling again
                    session.fork(shared[0].row, seq.row)
                    self._first_token(seq, shared[1], running)
                else:
                    session.prefix(seq.row, seq.tokens_to_prefill())
                    prefilling, seq.status = seq, "prefilling"
            if prefilling is not None:
                seq, tokens = prefilling, prefilling.tokens_to_prefill()
                held = session.lengths[seq.row]
                size = self.chunk_size if self.mode == "chunked" else len(tokens) - held
                try:
                    logits = session.adopt(seq.row, tokens, self.mode, self.chunk_size, self.store) \
                        if self.store is not None and not held else None
                    if logits is None:  # the policy's own prefill
                        logits = session.prefill_chunk(seq.row, tokens[held:held + size], self.mode, len(tokens))
                except (DeviceOOM, torch.OutOfMemoryError) as exc:
                    if not (self.continuous and isinstance(exc, OutOfBlocks)):
                        return oom_record(exc, "prefill")
                    if not running:
                        raise UserError(f"the block pool cannot hold request {seq.index} ({len(tokens)} tokens) even "
                                        f"alone: {exc}") from exc
                    if self.compress_to_admit and self._compress_one(session, running, step, "admission"):
                        continue  # the same chunk again, with the blocks a running request gave back
                    # never preempt (or, by default, compress) running requests for a new one: it waits for room
                    self._leave(session, seq, free_rows)
                    waiting.appendleft(seq)
                    prefilling, blocked = None, True
                    continue
                if session.lengths[seq.row] == len(tokens):
                    prefilling = None
                    if self.share and not seq.generated:
                        self.first_of.setdefault(tuple(seq.prompt), (seq, logits))
                    if seq.generated:  # recomputed after a preemption: it goes on where it was
                        seq.status = "running"
                        running.append(seq)
                    else:
                        self._first_token(seq, logits, running)
                        if seq.status == "finished" and self.continuous:
                            self._leave(session, seq, free_rows)
            decode_now = self.continuous or not (pending or waiting or prefilling)
            if running and decode_now:
                try:
                    logits = session.decode([s.row for s in running], [s.generated[-1] for s in running])
                except (DeviceOOM, torch.OutOfMemoryError) as exc:
                    if not (self.continuous and isinstance(exc, OutOfBlocks)):
                        return oom_record(exc, "decode")
                    if self._compress_one(session, running, step, "decode"):
                        # what it gave back is for the running requests to grow into: as after a preemption, a
                        # waiting request is admitted once one has left
                        blocked = True
                        continue
                    if len(running) == 1:
                        raise UserError(f"the block pool cannot hold request {running[0].index} even alone: "
                                        f"{exc}") from exc
                    victim = running.pop()  # the newest: it waits, first in line, until another request has left
                    self._leave(session, victim, free_rows)
                    victim.status = "waiting"
                    waiting.appendleft(victim)
                    self.preemptions += 1
                    blocked = True
                    continue
                stepped = list(running)
                for seq, row_logits in zip(stepped, logits):
                    seq.take(row_logits)
                self.clock.handed(seq.index for seq in stepped)
                for seq in stepped:
                    if seq.done(self.eos):
                        seq.status = "finished"
                        running.remove(seq)
                        if self.continuous:
                            self._leave(session, seq, free_rows)
                            blocked = False
            settle()
            step += 1
        return None

    def _compress_one(self, session, running: list[Sequence], step: int, needed_for: str) -> bool:
        """The compress schedule: compact a running request, the least compressed so far and, among those, the
        longest-running (the first admitted); False where none can shrink any more (or the schedule preempts)."""
        if self.compress_share is None:
            return False
        times = {}
        for c in self.compressions:
            times[c["request"]] = times.get(c["request"], 0) + 1
        for seq in sorted(running, key=lambda s: times.get(s.index, 0)):  # stable: admission order among equals
            before, after = session.policy.compress(seq.row, self.compress_share)
            if after < before:
                self.compressions.append({"request": seq.index, "step": step, "at_s": self.clock.now(),
                                          "generated": len(seq.generated), "entries_before": before,
                                          "entries_after": after, "needed_for": needed_for})
                return True
        return False

    def _leave(self, session, seq: Sequence, free_rows: deque) -> None:
        """The request gives its row back (finished, preempted, or not admitted after all); a later request with the
        same prompt can no longer fork it."""
        session.release(seq.row)
        free_rows.append(seq.row)
        seq.row = -1
        self.first_of = {prompt: first for prompt, first in self.first_of.items() if first[0] is not seq}

    def _first_token(self, seq: Sequence, logits, running: list[Sequence]) -> None:
        seq.take(logits)
        self.clock.handed([seq.index])
        if seq.done(self.eos):
            seq.status = "finished"
        else:
            seq.status = "running"
            running.append(seq)

    def result(self, oom: dict | None, memory: dict | None = None, stats: dict | None = None,
               setup_s: float | None = None) -> RunResult:
        engine = self.engine
        outputs = decoded_outputs(engine.model.tokenizer, [s.generated for s in self.seqs],
                                  [s.prompt for s in self.seqs])
        if any(s.forced is not None for s in self.seqs):
            for out, seq in zip(outputs, self.seqs):
                out.update(logprobs=seq.logprobs, greedy=seq.greedy)
        metrics = build_metrics(
            **self.clock.metrics(), sections=dict(engine.timers.seconds), setup_s=setup_s, completed=oom is None,
            preemptions=self.preemptions,
            **latency_metrics(self.clock, self.slo.get("ttft_s"), self.slo.get("tpot_s")))
        return RunResult(outputs=outputs, metrics=metrics, memory=memory or engine.ledger.snapshot(),
                         policy={"name": engine.policy.name, **engine.policy.settings()}, oom=oom,
                         stats=stats or {})
