"""One generation engine for every policy: prefill each prompt (whole, or in chunks), then greedy decode in a batch.

The paper prefills H2O's and InfiniGen's prompts one at a time and decodes them together; the engine does the same for
every policy, so a difference between policies is a difference of KV-cache management, not of schedule. Continuous
batching (requests joining and leaving between decode steps) lives in kvlib.scheduler on the same forward pass.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from kvlib.errors import DeviceOOM, UserError
from kvlib.ledger import MemoryLedger
from kvlib.models import LoadedModel
from kvlib.policies.base import PREFILL_MODES, KVPolicy, Step
from kvlib.timing import Timers


@dataclass
class RunResult:
    outputs: list[dict]
    metrics: dict
    memory: dict
    policy: dict
    oom: dict | None = None
    stats: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"outputs": self.outputs, "metrics": self.metrics, "memory": self.memory, "policy": self.policy,
                "oom": self.oom, "policy_stats": self.stats}


def activation_bytes(model: LoadedModel, batch: int, q_len: int) -> int:
    """Working set of one forward pass outside attention: residual, normed input, Q/K/V, MLP, last-token logits."""
    c, s = model.model.config, model.spec
    per_token = (2 * s.hidden_size + (s.num_attention_heads + 2 * s.num_kv_heads) * s.head_dim
                 + 3 * c.intermediate_size)
    return batch * q_len * per_token * s.dtype_bytes + batch * c.vocab_size * 4


def run_metrics(*, ttft: list[float], step_latencies: list[float], prefill_s: float, decode_s: float,
                total_s: float, decode_tokens: int, wall_split: dict, completed: bool = True, **extra) -> dict:
    """The metrics every run reports, whatever produced it (the static engine, the scheduler, the real vLLM)."""
    return {
        "ttft_s": statistics.fmean(ttft) if ttft else None,
        "ttft_per_request_s": ttft,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "total_s": total_s,
        "decode_tokens": decode_tokens,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 and decode_tokens else None,
        "decode_step_s_mean": statistics.fmean(step_latencies) if step_latencies else None,
        "decode_step_s_p50": statistics.median(step_latencies) if step_latencies else None,
        "decode_steps": len(step_latencies),
        "wall_split_s": wall_split,
        "completed": completed,
        **extra,
    }


def decoded_outputs(tokenizer, generated: list[list[int]], prompts: list[list[int]]) -> list[dict]:
    return [{"token_ids": g, "text": tokenizer.decode(g, skip_special_tokens=True), "prompt_tokens": len(p)}
            for g, p in zip(generated, prompts)]


class Engine:
    def __init__(self, model: LoadedModel, policy: KVPolicy, device_capacity_bytes: int | None = None):
        self.model, self.policy = model, policy
        self.ledger = MemoryLedger(device_capacity_bytes)
        self.timers = Timers(model.device)
        self.ledger.add("device", "weights", model.weights_bytes, where="model weights")
        policy.bind(model, self.ledger, self.timers)

    # -- the one forward pass every schedule uses ----------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, step: Step) -> torch.Tensor:
        """Run the model on [B, T] new tokens of step.rows; return the last position's logits [B, V] (fp32)."""
        positions = step.start[:, None] + torch.arange(step.q_len)[None, :]
        where = f"{step.phase} forward"
        with self.timers.section("cache_ops"):
            self.policy.prepare(step)
        with self.ledger.transient("device", "activations", activation_bytes(self.model, *input_ids.shape), where):
            out = self.model.model(input_ids=input_ids.to(self.model.device),
                                   position_ids=positions.to(self.model.device),
                                   use_cache=False, logits_to_keep=1, kv_step=step)
        self.policy.after_pass(step)
        return out.logits[:, -1].float()

    def prefill(self, row: int, prompt: list[int], mode: str, chunk_size: int, start: int = 0) -> torch.Tensor:
        """Feed a row its prompt, whole or in chunks; return the logits after its last token. With start > 0 the row
        already holds `start` tokens and the prompt extends it (the next turn of a conversation)."""
        size = chunk_size if mode == "chunked" else len(prompt)
        logits = None
        cached = 0
        if start == 0:
            with self.timers.section("cache_ops"):
                cached = self.policy.reuse_prefix(row, prompt)
        for begin in range(cached, len(prompt), size):
            chunk = prompt[begin:begin + size]
            step = Step(self.policy, torch.tensor([row]), torch.tensor([start + begin]), len(chunk), "prefill", mode,
                        last_chunk=begin + size >= len(prompt))
            logits = self.forward(torch.tensor([chunk]), step)
        return logits[0]

    def decode_step(self, rows: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One decode pass: row rows[i] is fed tokens[i] at position positions[i]; returns logits [B, V]."""
        rows_t = torch.tensor(rows)
        return self.forward(torch.tensor(tokens)[:, None], Step(self.policy, rows_t, torch.tensor(positions), 1,
                                                                "decode"))

    # -- static batch: sequential prefill, batched decode ------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_new_tokens: int, prefill_mode: str = "fused",
                 chunk_size: int = 512, stop_at_eos: bool = True, forced: list[list[int]] | None = None,
                 share_prompts: bool = False) -> RunResult:
        """Greedy generation; with `forced`, teacher forcing: row r is fed forced[r] instead of its own choices and
        each output carries the log-probabilities of those tokens (`logprobs`) and whether each was the greedy choice
        (`greedy`), while the policy keeps, evicts and fetches exactly as it does when generating (how a KV budget
        acts on a scored continuation). With share_prompts, a prompt equal to an earlier row's is not prefilled
        again: the policy forks that row (the answer choices of one question share their context)."""
        if forced is not None:
            if len(forced) != len(prompts) or not all(forced):
                raise UserError("forced needs one non-empty continuation per prompt")
            max_new_tokens = max(map(len, forced))
        self.validate(prompts, max_new_tokens, prefill_mode, chunk_size)
        eos = self.model.tokenizer.eos_token_id if stop_at_eos and forced is None else None
        n = len(prompts)
        generated: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        greedy: list[list[bool]] = [[] for _ in range(n)]

        def take(row: int, logits: torch.Tensor) -> None:
            best = int(logits.argmax())
            token = forced[row][len(generated[row])] if forced is not None else best
            if forced is not None:
                logprobs[row].append(float(torch.log_softmax(logits, dim=-1)[token]))
                greedy[row].append(token == best)
            generated[row].append(token)

        def finished(row: int) -> bool:
            if forced is not None:
                return len(generated[row]) == len(forced[row])
            return eos is not None and generated[row][-1] == eos

        ttft: list[float] = []
        step_latencies: list[float] = []
        oom = None
        self.timers.seconds.clear()
        self.ledger.reset_peaks()
        t0 = time.perf_counter()
        prefill_end = decode_end = t0
        try:
            self.policy.start(n, [len(p) for p in prompts], max_new_tokens)
            first_row: dict[tuple, int] = {}
            prefilled: dict[int, torch.Tensor] = {}
            for row, prompt in enumerate(prompts):
                src = first_row.setdefault(tuple(prompt), row) if share_prompts else row
                if src == row:
                    prefilled[row] = self.prefill(row, prompt, prefill_mode, chunk_size)
                else:
                    with self.timers.section("cache_ops"):
                        self.policy.fork(src, row)
                take(row, prefilled[src])
                ttft.append(self.timers.now() - t0)
            prefill_end = self.timers.now()
            policy_prefill = self._policy_seconds()
            for _ in range(max_new_tokens - 1):
                live = [r for r in range(n) if not finished(r)]
                if not live:
                    break
                begin = self.timers.now()
                logits = self.decode_step(live, [generated[r][-1] for r in live],
                                          [len(prompts[r]) + len(generated[r]) - 1 for r in live])
                for i, r in enumerate(live):
                    take(r, logits[i])
                step_latencies.append(self.timers.now() - begin)
            decode_end = self.timers.now()
        except (DeviceOOM, torch.OutOfMemoryError) as exc:
            oom = self._oom_record(exc, phase="decode" if len(ttft) == n else "prefill")
            policy_prefill = self._policy_seconds()
        memory = self.ledger.snapshot()
        stats = self.policy.stats()
        policy_total = self._policy_seconds()
        self.policy.finish()
        outputs = decoded_outputs(self.model.tokenizer, generated, prompts)
        if forced is not None:
            for out, lp, gr in zip(outputs, logprobs, greedy):
                out.update(logprobs=lp, greedy=gr)
        return RunResult(
            outputs=outputs,
            metrics=self._metrics(ttft, step_latencies, t0, prefill_end, decode_end, policy_prefill, policy_total,
                                  generated, oom),
            memory=memory, policy={"name": self.policy.name, **self.policy.settings()}, oom=oom, stats=stats)

    # -- helpers ----------------------------------------------------------------------------------------------
    def validate(self, prompts, max_new_tokens, prefill_mode, chunk_size):
        """One clear error for a request this engine cannot run (the scheduler checks each request with it)."""
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

    def _policy_seconds(self) -> float:
        return sum(self.timers.seconds.values())

    def _oom_record(self, exc, phase: str) -> dict:
        if isinstance(exc, DeviceOOM):
            return {"phase": phase, "where": exc.where, "requested_bytes": exc.requested,
                    "in_use_bytes": exc.in_use, "capacity_bytes": exc.capacity, "kind": "capacity"}
        return {"phase": phase, "where": str(exc).splitlines()[0], "kind": "cuda"}

    def _metrics(self, ttft, step_latencies, t0, prefill_end, decode_end, policy_prefill, policy_total, generated,
                 oom) -> dict:
        prefill_s = max(prefill_end - t0, 0.0)
        decode_s = max(decode_end - prefill_end, 0.0)
        return run_metrics(
            ttft=ttft, step_latencies=step_latencies, prefill_s=prefill_s, decode_s=decode_s,
            total_s=prefill_s + decode_s, decode_tokens=sum(max(len(g) - 1, 0) for g in generated),
            wall_split={"prefill": prefill_s - policy_prefill, "cache_ops": policy_total,
                        "decode": decode_s - (policy_total - policy_prefill)},
            completed=oom is None, sections_s=dict(self.timers.seconds))
