"""Continuous batching on the engine's forward pass (vLLM's scheduling, simplified).

Requests arrive at given decode steps. Each iteration prefills one chunk of the oldest waiting request (chunked prefill
interleaved with decoding) and then runs one decode step for every running request; finished requests leave and free
their blocks at once. When the pool runs out of blocks, the newest running request is preempted: its blocks are freed
and it is queued again, to be recomputed from its prompt and the tokens it had generated. Needs a policy that can
release single rows (`paged`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from kvlib.block_pool import OutOfBlocks
from kvlib.engine import Engine, RunResult, decoded_outputs, run_metrics
from kvlib.errors import UserError
from kvlib.policies.base import KVPolicy, Step


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    arrival_step: int = 0


def serve(engine: Engine, requests: list[Request], chunk_size: int = 512, max_batch: int | None = None) -> RunResult:
    policy = engine.policy
    if type(policy).release is KVPolicy.release:  # the base class cannot drop single rows
        raise UserError(f"continuous batching needs a policy that can release single rows; {policy.name!r} cannot")
    for r in requests:
        engine.validate([r.prompt], r.max_new_tokens, "chunked", chunk_size)
    n = len(requests)
    generated: list[list[int]] = [[] for _ in range(n)]
    ttft: list[float | None] = [None] * n
    arrived_at: list[float | None] = [None] * n
    engine.timers.seconds.clear()
    engine.ledger.reset_peaks()
    policy.start(n, [len(r.prompt) for r in requests], max(r.max_new_tokens for r in requests))
    pending = deque(sorted(range(n), key=lambda i: requests[i].arrival_step))
    waiting: deque[int] = deque()
    running: list[int] = []
    prefilling: tuple[int, list[int], int] | None = None  # (row, tokens to prefill, next offset)
    preemptions = step = decode_tokens = 0
    admit_blocked = False  # after a prefill ran out of blocks: admit again only once a running request has left
    decode_s = prefill_s = 0.0
    latencies: list[float] = []
    t0 = time.perf_counter()

    def preempt() -> None:
        """Free the newest running request's blocks; it waits (first in line) until another request has left."""
        nonlocal preemptions, admit_blocked
        victim = running.pop()
        policy.release(victim)
        waiting.appendleft(victim)
        preemptions += 1
        admit_blocked = True

    while pending or waiting or running or prefilling:
        while pending and requests[pending[0]].arrival_step <= step:
            row = pending.popleft()
            arrived_at[row] = time.perf_counter()
            waiting.append(row)
        room = max_batch is None or len(running) < max_batch
        if prefilling is None and waiting and (not admit_blocked or not running) and room:
            row = waiting.popleft()
            # a preempted request is recomputed: its prompt plus what it generated, but the last token, is re-prefilled
            tokens = requests[row].prompt + generated[row][:-1]
            prefilling = (row, tokens, policy.reuse_prefix(row, tokens))
        if prefilling is not None:
            row, tokens, offset = prefilling
            size = min(chunk_size, len(tokens) - offset)
            begin = time.perf_counter()
            try:
                logits = engine.forward(torch.tensor([tokens[offset:offset + size]]),
                                        Step(policy, torch.tensor([row]), torch.tensor([offset]), size, "prefill",
                                             "chunked", last_chunk=offset + size == len(tokens)))
            except OutOfBlocks as exc:
                if not running:
                    raise UserError(f"the block pool cannot hold request {row} ({len(tokens)} tokens) even alone: "
                                    f"{exc}") from exc
                # never preempt running requests for a new one (they would take turns forever): wait for room
                policy.release(row)
                waiting.appendleft(row)
                prefilling, admit_blocked = None, True
                continue
            prefill_s += time.perf_counter() - begin
            if offset + size < len(tokens):
                prefilling = (row, tokens, offset + size)
            else:
                prefilling = None
                if not generated[row]:
                    generated[row].append(int(logits[0].argmax()))
                    ttft[row] = time.perf_counter() - arrived_at[row]
                if len(generated[row]) < requests[row].max_new_tokens:
                    running.append(row)
                else:
                    policy.release(row)
        if running:
            rows = torch.tensor(running)
            starts = torch.tensor([len(requests[r].prompt) + len(generated[r]) - 1 for r in running])
            begin = time.perf_counter()
            try:
                logits = engine.forward(torch.tensor([[generated[r][-1]] for r in running]),
                                        Step(policy, rows, starts, 1, "decode"))
            except OutOfBlocks as exc:
                if len(running) == 1:
                    raise UserError(f"the block pool cannot hold request {running[0]} even alone: {exc}") from exc
                preempt()
                continue
            elapsed = time.perf_counter() - begin
            decode_s += elapsed
            latencies.append(elapsed)
            for r, tok in zip(list(running), logits.argmax(-1).tolist()):
                generated[r].append(tok)
                decode_tokens += 1
                if len(generated[r]) >= requests[r].max_new_tokens:
                    running.remove(r)
                    policy.release(r)
                    admit_blocked = False
        step += 1
    total = time.perf_counter() - t0
    policy.preemptions = preemptions
    memory, stats = engine.ledger.snapshot(), policy.stats()
    cache_ops = sum(engine.timers.seconds.values())
    policy.finish()
    metrics = run_metrics(ttft=ttft, step_latencies=latencies, prefill_s=prefill_s, decode_s=decode_s, total_s=total,
                          decode_tokens=decode_tokens,
                          wall_split={"prefill": prefill_s, "cache_ops": cache_ops,
                                      "decode": total - prefill_s - cache_ops},
                          sections_s=dict(engine.timers.seconds), preemptions=preemptions)
    return RunResult(
        outputs=decoded_outputs(engine.model.tokenizer, generated, [r.prompt for r in requests]),
        metrics=metrics, memory=memory, policy={"name": policy.name, **policy.settings()}, stats=stats)
