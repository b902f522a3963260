"""The one loop that serves requests on the engine, under one of three schedules.

`static` is the paper's schedule for H2O and InfiniGen, applied to every policy: each prompt is prefilled in turn
(whole, or chunk by chunk), then all requests decode together; finished rows stay allocated until the run ends;
running out of device memory ends the run as a recorded OOM point.

`continuous` is vLLM's: requests arrive at given decode steps, or at given times (a request rate: an open loop,
kvlib.engine.arrivals, each request joining when the clock passes its arrival); each iteration prefills one chunk of
the oldest waiting request (under `chunked` prefill; its whole prompt under `full` or `fused`, as vLLM without chunked
prefill) and then runs one decode step for every running request; finished requests leave and free their rows at once.
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

All go through the same Session (kvlib.engine.session), so they are timed and booked alike; only the order of work
differs. The three are settings of one loop (a run's RunSettings, resolved into a Schedule; Engine.run is the entry
point), in nano-vllm's shape (Scheduler): each request a Sequence with a status (kvlib.engine.sequence); `schedule`
returns a step's work (a prefill pass, then a decode step); before the session runs a pass, the policy says what it
would take from its block pool (KVPolicy.pool_room), and where the pool is short the pass does not run: the
schedule's answer (`pool_ran_out`: preempt, or compress first, the one method `make_room` the schedule chose) comes
first, as nano-vllm's scheduler asks its block manager before the step; `postprocess` hands the tokens over and
retires the finished.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvlib.engine.prefill_record import PrefillStore
from kvlib.engine.run_result import TokenClock, oom_record
from kvlib.engine.sequence import Sequence
from kvlib.engine.session import Session
from kvlib.errors import DeviceOOM, RequestTooLarge, UserError
from kvlib.memory.block_pool import PoolRoom
from kvlib.models.passes import Step
from kvlib.policies.base import KVPolicy

__all__ = ["BATCHING", "SCHEDULES", "RunSettings", "Schedule", "Scheduler", "Sequence"]

SCHEDULES = ("static", "continuous", "compress")
# each schedule in the poster's words (its "batching" row), recorded with every run (kvlib.report.findings.systems); short,
# since they are a table's column (the module's docstring says what each does)
BATCHING = {"static": "static", "continuous": "continuous, preempts when full",
            "compress": "continuous, compresses then preempts when full"}


@dataclass(frozen=True)
class RunSettings:
    """How a run serves its requests (Engine.run): the schedule, how prompts are prefilled, and when a request stops.
    slo: {"ttft_s": ..., "tpot_s": ...}, the limits goodput counts against (kvlib.engine.run_result.latency_metrics).
    compress_share: under the `compress` schedule, the share of its entries a compressed request keeps; None: the
    policy's own (KVPolicy.compress_share). prefill_store (static schedule): a PrefillStore whose records the policy
    adopts (Session.adopt)."""

    schedule: str = "static"
    prefill_mode: str = "fused"
    chunk_size: int = 512
    stop_at_eos: bool = True
    share_prompts: bool = False  # a fresh request whose prompt an earlier row holds forks that row
    slo: dict | None = None
    compress_share: float | None = None
    prefill_store: PrefillStore | None = None


@dataclass(frozen=True)
class Schedule:
    """A run's settings resolved against its policy, as the one loop reads them."""

    name: str
    # requests come and go: decode steps interleave with prefills, a finished request gives its row back at once,
    # and a full block pool is waited out (Scheduler.make_room) instead of ending the run
    serving: bool
    compress_share: float | None  # the compress schedule's share a compacted request keeps; None: it preempts
    compress_to_admit: bool  # also compact a running request to let a waiting one in (the policy's setting)
    prefill_mode: str
    chunk_size: int
    eos: int | None
    share_prompts: bool
    prefill_store: PrefillStore | None  # static schedule: prefills adopted from its records (Session.prefill_next)

    def without_eos(self) -> Schedule:
        """Teacher forcing: a forced request runs its whole continuation, whatever tokens it holds."""
        return dataclasses.replace(self, eos=None)


@dataclass
class Work:
    """One pass of a step's work: the next chunk of one request's prefill, or a decode step of several."""

    phase: str  # "prefill" or "decode"
    seqs: list[Sequence]


def resolve(settings: RunSettings, policy: KVPolicy, eos: int | None) -> Schedule:
    """The settings as the loop reads them, with one clear error for a schedule this policy cannot serve under."""
    name, store = settings.schedule, settings.prefill_store
    if name not in SCHEDULES:
        raise UserError(f"unknown schedule {name!r}; choose from {list(SCHEDULES)}")
    share = policy.compress_share if settings.compress_share is None else settings.compress_share
    if name == "compress":
        if not policy.can_compress:
            raise UserError(f"the compress schedule needs a policy that compacts a running request's cache by its "
                            f"scores (h2o, snapkv); {policy.name!r} cannot")
        if not 0 < share < 1:
            raise UserError(f"compress_share must be in (0, 1), got {share}")
    if name != "static":
        if not policy.can_release:
            raise UserError(f"continuous batching needs a policy that can release single rows; "
                            f"{policy.name!r} cannot")
        if store is not None:
            raise ValueError("a prefill store serves the static schedule: continuous batching interleaves a prompt's "
                             "chunks with decode steps, and an adopted prefill would take them all at once")
    return Schedule(name, name != "static", share if name == "compress" else None, policy.compress_to_admit,
                    settings.prefill_mode, settings.chunk_size, eos if settings.stop_at_eos else None,
                    settings.share_prompts, store)


class Scheduler:
    """One run's requests on an open session, each with its status: `schedule` picks a step's work, the session runs
    it, `postprocess` hands its tokens over and retires the finished. A pass the block pool cannot hold (asked before
    it runs) goes to `pool_ran_out`, whose answer (`make_room`: preempt, or compress first) the schedule chose."""

    def __init__(self, session: Session, sequences: list[Sequence], settings: Schedule):
        self.session, self.settings = session, settings
        self.pending = deque(sorted(sequences, key=lambda s: (s.arrival_s or 0.0, s.arrival_step)))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefilling: Sequence | None = None
        # the cache rows the policy holds, handed to requests as they are admitted: every request's own row under the
        # static schedule; under a serving one a policy that reserves a whole row up front (full, KIVI, InfiniGen)
        # holds as many as its capacity affords, and a request waits for one to be free
        self.free_rows = deque(range(session.rows))
        self.blocked = False  # the pool ran out: admit again once a running request has left
        self.first_of: dict[tuple, tuple[Sequence, torch.Tensor]] = {}  # prompt -> its first request and logits
        self.step, self.preemptions, self.compressions = 0, 0, []
        self.make_room = self._compress_or_preempt if settings.compress_share is not None else self._preempt
        self.clock = TokenClock(len(sequences))  # serving starts now

    def serve(self) -> dict | None:
        """Run until every request has finished; returns an OOM record if the device ran out. Before each pass the
        policy is asked what it would take from its block pool (pool_room): a serving schedule makes room first
        (pool_ran_out), the static one records the pool's OOM; nothing is learnt from inside the forward pass."""
        while self.pending or self.waiting or self.running or self.prefilling:
            self.arrive()
            for work in self.schedule():
                step = self.step_of(work)
                room = self.session.room(step)
                if room is not None and room.short:
                    if not self.settings.serving:
                        return oom_record(room.error(), work.phase)
                    self.pool_ran_out(work, room)
                    break  # the step again, in the room made (or without the request that found none)
                try:
                    logits = self.run_pass(work, step)
                except (DeviceOOM, torch.OutOfMemoryError) as exc:
                    return oom_record(exc, work.phase)
                self.postprocess(work, logits)
            else:
                self.session.timers.now()  # on CUDA the step's one synchronization, and its sections read
                self.step += 1
        return None

    def arrive(self) -> None:
        """Requests whose arrival (step, and time) has come join the waiting line; with none to serve meanwhile, the
        loop idles until the next one comes."""
        pending = self.pending
        if pending and not (self.waiting or self.running or self.prefilling) and pending[0].arrival_s is not None:
            time.sleep(max(pending[0].arrival_s - self.clock.now(), 0.0))
        while pending and pending[0].arrival_step <= self.step and (pending[0].arrival_s or 0.0) <= self.clock.now():
            seq = pending.popleft()
            self.clock.arrive(seq.index, at=seq.arrival_s)
            seq.status = "waiting"
            self.waiting.append(seq)

    def schedule(self) -> Iterator[Work]:
        """One step's work, in order: the next pass of the prompt being prefilled (the next waiting request admitted
        first where none is, while a row is free and no running request is owed the room), then a decode step of the
        running requests where the schedule decodes now (the static one once every prompt is in). A generator: the
        decode rows are chosen after the prefill pass has run, so a prompt it completes decodes in the same step."""
        if self.prefilling is None and self.waiting and self.free_rows and (not self.blocked or not self.running):
            self.admit(self.waiting.popleft())
        if self.prefilling is not None:
            yield Work("prefill", [self.prefilling])
        if self.running and (self.settings.serving or not (self.pending or self.waiting or self.prefilling)):
            yield Work("decode", list(self.running))

    def admit(self, seq: Sequence) -> None:
        """A waiting request takes a free row: a fresh one whose prompt an earlier row holds forks that row and has
        its first token at once (share_prompts); any other starts its prefill after what the policy has cached."""
        seq.row = self.free_rows.popleft()
        shared = self.first_of.get(tuple(seq.prompt)) if self.settings.share_prompts and not seq.generated else None
        if shared is not None:
            self.session.fork(shared[0].row, seq.row)
            self.hand_over([seq], [shared[1]])
        else:
            self.session.prefix(seq.row, seq.tokens_to_prefill())
            self.prefilling, seq.status = seq, "prefilling"

    def step_of(self, work: Work) -> Step:
        """The pass the session would run for the work (its own prefill's next pass; a prefill adopted from a store
        takes the same blocks at its first pass, the static schedule's)."""
        if work.phase == "decode":
            return self.session.decode_step([seq.row for seq in work.seqs])
        seq, s = work.seqs[0], self.settings
        tokens = seq.tokens_to_prefill()
        chunk = self.session.next_prefill(seq.row, tokens, s.prefill_mode, s.chunk_size)
        return self.session.prefill_step(seq.row, len(chunk), s.prefill_mode, len(tokens))

    def run_pass(self, work: Work, step: Step) -> torch.Tensor:
        """The session runs the pass whose room was asked (`step`, step_of's); its logits (may raise DeviceOOM)."""
        s, session = self.settings, self.session
        if work.phase == "decode":
            return session.decode([seq.row for seq in work.seqs], [seq.generated[-1] for seq in work.seqs], step)
        seq = work.seqs[0]
        return session.prefill_next(seq.row, seq.tokens_to_prefill(), s.prefill_mode, s.chunk_size, s.prefill_store,
                                    step)

    def postprocess(self, work: Work, logits: torch.Tensor) -> None:
        """After a pass: each decoding request's next token; or, once a request's prompt is all in, its first token
        (one recomputed after a preemption goes on where it was, its token already out)."""
        if work.phase == "decode":
            self.hand_over(work.seqs, logits)
            return
        seq = work.seqs[0]
        if self.session.lengths[seq.row] < len(seq.tokens_to_prefill()):
            return  # chunks to go
        self.prefilling = None
        if self.settings.share_prompts and not seq.generated:
            self.first_of.setdefault(tuple(seq.prompt), (seq, logits))
        if seq.generated:
            self._join(seq)
        else:
            self.hand_over([seq], [logits])

    def hand_over(self, seqs: list[Sequence], logits) -> None:
        """Each request takes the token its logits choose, handed over now; a finished one retires, one that had no
        token before joins the running ones."""
        for seq, row_logits in zip(seqs, logits):
            seq.take(row_logits)
        self.clock.handed(seq.index for seq in seqs)
        for seq in seqs:
            if seq.done(self.settings.eos):
                self.retire(seq)
            elif seq.status != "running":
                self._join(seq)

    def retire(self, seq: Sequence) -> None:
        """A finished request leaves: a running one's leaving lets waiting ones in again; its row is given back at
        once under a serving schedule, at the end of the run under the static one."""
        if seq.status == "running":
            self.running.remove(seq)
            self.blocked = False
        seq.status = "finished"
        if self.settings.serving:
            self._leave(seq)

    def pool_ran_out(self, work: Work, room: PoolRoom) -> None:
        """A serving schedule's answer to a pass its block pool cannot hold. A decode step goes on once the schedule
        has made room (make_room); a prefill too where the schedule makes room to admit, else the request waits,
        first in line: running requests are never preempted for a new one. Either way, waiting requests are admitted
        again once a running one has left (blocked): the room made is the running ones'."""
        seq, lack = work.seqs[0], room.error()
        if work.phase == "decode":
            if not self.make_room("decode"):
                raise RequestTooLarge(f"the block pool cannot hold request {seq.index} even alone: {lack}")
        elif not self.running:
            raise RequestTooLarge(f"the block pool cannot hold request {seq.index} ({len(seq.tokens_to_prefill())} "
                                  f"tokens) even alone: {lack}")
        elif self.make_room("admission"):
            return  # the same chunk again, in the blocks a running request gave back
        else:
            self._leave(seq)
            seq.status = "waiting"
            self.waiting.appendleft(seq)
            self.prefilling = None
        self.blocked = True

    def _preempt(self, needed_for: str) -> bool:
        """vLLM's answer: the newest running request gives its blocks back and waits, first in line, to be recomputed
        from its tokens. Never for a waiting request, nor the last one running (False: no room made)."""
        if needed_for != "decode" or len(self.running) == 1:
            return False
        victim = self.running.pop()
        self._leave(victim)
        victim.status = "preempted"
        self.waiting.appendleft(victim)
        self.preemptions += 1
        return True

    def _compress_or_preempt(self, needed_for: str) -> bool:
        """The compress schedule's answer: compact a running request so that the running ones go on (and to admit a
        waiting one only where the policy's compress_to_admit says so); where none can shrink, preempt as vLLM does."""
        wanted = needed_for == "decode" or self.settings.compress_to_admit
        return (wanted and self._compress_one(needed_for)) or self._preempt(needed_for)

    def _compress_one(self, needed_for: str) -> bool:
        """Compact a running request, the least compressed so far and, among those, the longest-running (the first
        admitted); False where none can shrink any more."""
        for seq in sorted(self.running, key=lambda s: s.compressions):  # stable: admission order among equals
            before, after = self.session.policy.compress(seq.row, self.settings.compress_share)
            if after < before:
                seq.compressions += 1
                self.compressions.append({"request": seq.index, "step": self.step, "at_s": self.clock.now(),
                                          "generated": len(seq.generated), "entries_before": before,
                                          "entries_after": after, "needed_for": needed_for})
                return True
        return False

    def _join(self, seq: Sequence) -> None:
        seq.status = "running"
        self.running.append(seq)

    def _leave(self, seq: Sequence) -> None:
        """The request gives its row back (finished, preempted, or not admitted after all); a later request with the
        same prompt can no longer fork it."""
        self.session.release(seq.row)
        self.free_rows.append(seq.row)
        seq.row = -1
        self.first_of = {prompt: first for prompt, first in self.first_of.items() if first[0] is not seq}
