"""The contract every KV-cache policy implements.

The engine runs the model one forward pass at a time; each pass covers some rows of the batch (one row while a prompt
is prefilled, all live rows while decoding). For each layer the model's attention module hands the policy the new
queries, keys and values (RoPE applied); the policy stores the keys/values its own way, decides what attention sees,
and returns the attention output. Everything the policy holds is booked in the ledger by tier and component. What a
pass carries (Step, a recorded prefill's RecordedPass) is kvlib.models.passes'; KVPolicy says which methods a policy
implements and which the engine provides.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlib.errors import UserError
from kvlib.kernels.decode import DecodeReads, decode_attention, kernel_for, workspace_bytes
from kvlib.memory.block_pool import PoolRoom
from kvlib.memory.ledger import MemoryLedger
from kvlib.memory.timing import Timers
from kvlib.memory.work import Work
from kvlib.models import LoadedModel
from kvlib.models.passes import RecordedPass, Step
from kvlib.policies.fidelity import Fidelity

PREFILL_MODES = ("full", "fused", "chunked")


class KVUsage:
    """What attention read during decode, per layer: the tokens attended against the tokens the rows had seen. This
    is the KV share a policy actually used, whatever its budget setting says (a cap for InfiniGen, a target for H2O).
    Beside it, what the device held: after each decode step the ledger's device KV bytes against the tokens the open
    rows had seen (Session.decode books it for every policy alike), so that a policy's bytes per token seen are
    measured, not derived from its settings (a budget, 2-bit codes, streaming heads' rings)."""

    def __init__(self, layers: int):
        self.attended = [0] * layers
        self.seen = [0] * layers
        self.row_steps = 0
        self.held_bytes = 0  # device KV bytes after each decode step, summed over the steps
        self.held_tokens = 0  # tokens the open rows had seen after each decode step, summed over the steps

    def held(self, kv_bytes: int | None, tokens: int) -> None:
        """After a decode step: the device's KV bytes (None where the run books nothing) and the rows' tokens seen."""
        if kv_bytes is None:
            self.held_bytes = None
        elif self.held_bytes is not None:
            self.held_bytes += kv_bytes
            self.held_tokens += tokens

    def add(self, layer: int, attended: int, seen: int, rows: int) -> None:
        """attended, seen: summed over the step's rows (per KV head: the mean over heads)."""
        self.attended[layer] += attended
        self.seen[layer] += seen
        if layer == 0:
            self.row_steps += rows

    def summary(self) -> dict:
        totals = {"kv_tokens_attended_total": sum(self.attended), "kv_tokens_seen_total": sum(self.seen),
                  "kv_device_bytes_held_total": self.held_bytes, "kv_tokens_held_total": self.held_tokens,
                  "kv_device_bytes_per_token": self.held_bytes / self.held_tokens
                  if self.held_bytes is not None and self.held_tokens else None}
        if not self.row_steps:
            return {"kv_share_attended": None, "kv_share_attended_per_layer": None,
                    "kv_tokens_attended_per_step": None, **totals}
        return {**totals, "kv_share_attended": sum(self.attended) / max(sum(self.seen), 1),
                "kv_share_attended_per_layer": [a / max(s, 1) for a, s in zip(self.attended, self.seen)],
                "kv_tokens_attended_per_step": sum(self.attended) / len(self.attended) / self.row_steps}



@dataclass
class KVPolicy:
    """The base of every policy; its settings are dataclass fields, so the CLI and params files can name them.

    Every policy implements two methods:
    - `start(batch_size, prompt_lens, max_new_tokens)`: allocate, and book, what a batch of rows holds;
    - `attend(layer, query, key, value, step)`: store a pass's keys and values, return attention's output.
    It declares what it is in the class variables below (its name, prefill modes, schedule, the poster's words, its
    fidelity, the settings the registry-wide tests run it at), and overrides, where it does more, what has a default
    here:
    - around each pass: `prepare` (reserve before it), `after_pass` (commit, evict after it), `reuse_prefix`;
    - around a run: `calibrate` (with `calibrates`, and `calibration_columns` saying what it chose),
      `weights_off_device`, `finish`, `stats`, `kv_bits`;
    - the capabilities a schedule or task uses where a policy has them, each raising by default: `fork`; `release`
      (continuous batching, `can_release`); `compress` (the compress schedule, `can_compress`, with `compress_share`
      and `compress_to_admit`); `adopt_pass` (an adopted prefill, with `adopts_prefill`, `prefill_arithmetic` and
      `prefill_queries`).
    The engine provides the rest, the same for every policy: `bind` and `open_session` (what a run and a session
    attach: model, ledger, timers, rows, the serving capacity, usage and work counters), `decode_attention` (the one
    decode kernel), `pool_blocks` and `row_capacity` (sizing under a capacity), `can_release`, `can_compress`,
    `check_prefill`, `traits`, `granularity` and `settings`."""

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""  # how result rows name it: its name, unless a subclass says otherwise
    outside: ClassVar[bool] = False  # a kvlib policy (kvlib.study.runners.Runner)
    lossless: ClassVar[bool] = False  # keeps and attends every entry: its outputs are the full cache's
    supported_prefill: ClassVar[tuple[str, ...]] = PREFILL_MODES
    preferred_prefill: ClassVar[str] = "fused"  # what experiments use when they do not vary the prefill mode
    serving_schedule: ClassVar[str] = "continuous"  # the scheduler's schedule it serves requests under
    calibrates: ClassVar[bool] = False  # learns something offline from a calibration text (calibrate())
    # attributes whose tensors live in the host tier (on a CPU both tiers are host memory; the census test and the
    # ledger need to know which is which)
    host_tensors: ClassVar[tuple[str, ...]] = ()
    # its prefill is one dense pass whose K/V (and statistics) it then stores its own way, so it can adopt a recorded
    # one (adopt_pass; kvlib.engine.prefill_record). Declared by each class itself, never inherited: a subclass that
    # changes what its prefill computes must not adopt by accident, and the default is to run its own prefill.
    adopts_prefill: ClassVar[bool] = False
    # a forked row shares its source's blocks, copied on write (fork): where answers fork off one prompt (a multiple-
    # choice task), the device holds that prompt once for all of them, so its bytes held per token seen are lower than
    # a policy's that copies it into each (kvlib.report.accuracy.frontier says so beside such a point)
    shares_forks: ClassVar[bool] = False
    # the mechanism in the words of the paper's poster, declared beside the code that does it; every run records them
    # (traits) and kvlib.report.findings.systems tabulates them next to what the runs measured (tiers, KV share attended)
    keeps: ClassVar[str] = "every entry"
    reads: ClassVar[str] = "all it keeps"
    evicts: ClassVar[str] = "nothing"
    # its official source and rules, each `same` or `differs: why` (kvlib.policies.fidelity); declared by each
    # registered class itself
    fidelity: ClassVar[Fidelity | None] = None
    # the compress schedule (kvlib.engine.scheduler), for a policy that can compress: the share of its entries a
    # compressed request keeps unless the run passes one, and whether a running request is also compressed to let a
    # waiting one in (vLLM's rule, the default: it waits). compress_h2o makes both settings.
    compress_share: ClassVar[float] = 0.5
    compress_to_admit: ClassVar[bool] = False
    # the official accuracy harness's rule (kvlib.evaluation.one_pass): one dense pass per scored request, each query
    # row attending what the rule keeps for it; where the rule comes from (repository path), "" where the policy has
    # none (the protocol refuses it)
    one_pass_source: ClassVar[str] = ""
    # settings the registry-wide tests run it at on a tiny model (tests/policies/policy_examples.py), so that a
    # policy brings its own: `small_example` puts its mechanism to work (a budget that evicts, a cache across
    # tiers), and `keeps_all_example` keeps and attends every entry with that path still running (its tokens are the
    # full cache's); a block size, and a cache on the device alone, are the test's to choose where the policy has them
    small_example: ClassVar[dict] = {}
    keeps_all_example: ClassVar[dict] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "label" not in cls.__dict__:
            cls.label = cls.name
        if "adopts_prefill" not in cls.__dict__:
            cls.adopts_prefill = False

    def bind(self, model: LoadedModel, ledger: MemoryLedger, timers: Timers) -> None:
        """Attach to a model before a run; called once per engine."""
        self.model, self.spec, self.ledger, self.timers = model, model.spec, ledger, timers
        self.device = model.device
        self.scale = self.spec.head_dim ** -0.5
        self.usage = KVUsage(self.spec.num_layers)
        self.work = Work(None)  # a session's counter replaces it (open_session; kvlib.memory.work)
        self.decode_kernel = kernel_for(self.spec, self.device)  # the machine's and model's choice, not the policy's
        self.serving_bytes: int | None = None
        self.rows = 0

    def open_session(self, rows: int, serving_bytes: int | None) -> None:
        """Before start, each session: the rows it opens, and the bytes a block pool gets when it serves requests
        under a device capacity (None: sized from the batch; pool_blocks); fresh usage and work counters."""
        self.rows = rows  # the cache rows the session holds open (start may lower it: row_capacity)
        self.serving_bytes = serving_bytes
        self.usage = KVUsage(self.spec.num_layers)
        self.work = Work(self.model.pass_shape)

    def decode_attention(self, layer: int, query: torch.Tensor, reads: DecodeReads
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode attention over what this step's rows read: the one kernel every policy runs
        (kvlib.kernels.decode), its workspace booked while it lives. Returns (out, probabilities summed over each KV
        head's group where reads.probs, else None)."""
        nbytes = workspace_bytes(self.decode_kernel, reads, query)
        if self.timers.phase == "decode":  # (a prefill's attention is counted by the engine, dense)
            self.work.decode_reads("decode", reads, query.shape[1] // reads.keys.shape[-3])
        with self.ledger.transient("device", "activations", nbytes, f"{self.name} decode attention, layer {layer}"):
            return decode_attention(self.decode_kernel, query, reads, self.scale)

    def weights_off_device(self) -> int:
        """Bytes of the model's weights this policy keeps off the device (FlexGen's placement), after bind: the session
        books the rest on the device before the policy starts, so a capacity below the whole model can still run."""
        return 0

    def calibrate(self, prompt: list[int]) -> None:
        """After bind, for a policy that `calibrates`: learn from these token ids (the caller's text)."""

    def calibration_columns(self) -> dict:
        """After a run, for a policy that calibrates: what its calibration chose and how much that choice depends on
        the text it learnt from (the accuracy experiment's columns); {} where there is nothing to say."""
        return {}

    def pool_blocks(self, needed: int, block_bytes: int, beside: int = 0) -> int:
        """The blocks a block-holding policy's pool gets: what this batch needs; or, when the engine serves requests
        under a device capacity (`serving_bytes`, open_session), as many as those bytes hold after what the
        policy holds `beside` the pool, as vLLM sizes its pool from the memory it is given, whatever the requests."""
        if self.serving_bytes is None:
            return needed
        room = self.serving_bytes - beside
        if room < block_bytes:
            raise UserError(f"the device capacity leaves policy {self.name!r} no room for one KV block "
                            f"({room / 2**20:.1f} MiB for a {block_bytes / 2**20:.2f} MiB block)")
        return room // block_bytes

    @property
    def can_release(self) -> bool:
        return type(self).release is not KVPolicy.release

    @property
    def can_compress(self) -> bool:
        return type(self).compress is not KVPolicy.compress

    def check_prefill(self, mode: str) -> None:
        if mode not in self.supported_prefill:
            raise UserError(f"policy {self.name!r} does not support prefill mode {mode!r}; "
                            f"supported: {list(self.supported_prefill)}")

    # -- adopting a recorded prefill (kvlib.engine.prefill_record) ------------------------------------------
    def prefill_arithmetic(self, mode: str, passes: int) -> str | None:
        """The dense computation this policy's own prefill of a fresh row does in `mode` over `passes` passes:
        "sdpa" (fused or chunked attention) or "matrix" (the materialized matrix, its probabilities summed per KV
        head as `received`), the record it can adopt; None where it runs its own prefill (not adopts_prefill, or a
        prefill that is not one dense pass, e.g. one that evicts or quantizes between chunks)."""
        if not self.adopts_prefill:
            return None
        return "matrix" if mode == "full" else "sdpa"

    def prefill_queries(self) -> int:
        """How many of the prompt's last queries adopt_pass reads (a record keeps a store's `query_window` of them)."""
        return 0

    def adopt_pass(self, layer: int, recorded: RecordedPass, step: Step) -> None:
        """One layer of one pass of an adopted prefill, between the engine's prepare(step) and after_pass(step):
        store recorded.key(layer)/value(layer) [1, Hkv, T, D] and fold its statistics exactly as attend's prefill
        branch does with the same tensors, by the same code, without computing attention."""
        raise NotImplementedError(f"policy {self.name!r} adopts no prefill")

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self, batch_size: int, prompt_lens: list[int], max_new_tokens: int) -> None:
        """Allocate for a batch of rows before any prefill. `self.rows` is batch_size when it is called; a policy that
        reserves each row's whole length up front (no blocks) lowers it, when serving, to the rows its capacity
        holds (`row_capacity`): a scheduler then admits a request only while a row is free."""
        raise NotImplementedError

    def row_capacity(self, batch_size: int, row_bytes: int, beside: int = 0) -> int:
        """The rows a policy that reserves `row_bytes` of device memory a row holds: every request's, or, when serving
        under a device capacity, as many as the capacity affords (pool_blocks, a row for a block), at most one a
        request."""
        self.rows = min(batch_size, self.pool_blocks(batch_size, row_bytes, beside))
        return self.rows

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, step: Step) -> torch.Tensor:
        """Store key/value [B, Hkv, T, D] for step.rows and return attention output [B, Hq, T, D]."""
        raise NotImplementedError

    def reuse_prefix(self, row: int, prompt: list[int]) -> int:
        """Before a row's prefill: how many leading prompt tokens are already cached (prefix sharing)."""
        return 0

    def pool_room(self, step: Step) -> PoolRoom | None:
        """What `prepare(step)` would take from the policy's block pool, against what it has free: the scheduler asks
        before the pass and admits, preempts or compresses first. None: it holds no block pool."""
        return None

    def prepare(self, step: Step) -> None:
        """Before a forward pass: reserve what it will write (may raise DeviceOOM before any compute)."""

    def fork(self, src: int, dst: int) -> None:
        """Make row dst a copy of row src's cache (dst's old content dropped): a branch off a shared prefix, e.g. the
        answer choices of one question, or a question asked of a conversation that goes on without it."""
        raise NotImplementedError(f"policy {self.name!r} cannot fork rows")

    def release(self, row: int) -> None:
        """Drop everything a row holds (finished early or preempted by a scheduler)."""
        raise NotImplementedError(f"policy {self.name!r} cannot release single rows")

    def compress(self, row: int, share: float) -> tuple[int, int]:
        """Compact a running row to `share` of its entries, chosen by the policy's scores, its freed blocks back to the
        pool (the compress schedule); returns the entries a KV head held before and after."""
        raise NotImplementedError(f"policy {self.name!r} cannot compress a row")

    def after_pass(self, step: Step) -> None:
        """Called after every forward pass (all layers done): commit lengths, evict, etc."""

    def finish(self) -> None:
        """Free everything the run allocated."""

    def stats(self) -> dict:
        """Policy-specific metrics for the result (hit rates, bytes moved, ...)."""
        return {}

    def traits(self) -> dict:
        """The mechanism as every run records it, with what its settings make of it (block size, bits)."""
        return {"keeps": self.keeps, "reads": self.reads, "evicts": self.evicts, "granularity": self.granularity(),
                "kv_bits": self.kv_bits()}

    def granularity(self) -> str:
        """The unit its cache is allocated in: blocks, for a policy with a `block_size` setting (the block pool's)."""
        size = getattr(self, "block_size", None)
        return f"blocks of {size} tokens" if size else "a row reserved whole"

    def kv_bits(self) -> int:
        """Bits a stored key or value element takes: the model's dtype, unless the policy quantizes."""
        return 8 * self.spec.dtype_bytes

    def settings(self) -> dict:
        from dataclasses import asdict
        return asdict(self)

    def one_pass_session(self):
        """What the one-pass protocol holds open around its passes (kvlib.evaluation.one_pass): nothing by default;
        a rule that reads more than a layer's own query and keys (InfiniGen's the previous layer's input) hooks it."""
        return contextlib.nullcontext()

    def one_pass_keep(self, layer: int, query: torch.Tensor, key: torch.Tensor,
                      scores: torch.Tensor) -> torch.Tensor | None:
        """The keys each query row attends in the one-pass protocol: bool [B, Hq, T, T] (True = attended; the causal
        mask is applied after), or None for every earlier one. query [B, Hq, T, D], key [B, Hkv, T, D] with RoPE;
        scores [B, Hq, T, T]: the scaled logits, -inf above the diagonal."""
        self.check_one_pass()
        raise NotImplementedError(f"{self.name} declares a one_pass_source but no one_pass_keep")

    def check_one_pass(self) -> None:
        """Refuse the one-pass protocol where the policy has no official rule for it."""
        if not self.one_pass_source:
            raise UserError(f"policy {self.name!r} has no official one-pass accuracy rule: run it under the deployed "
                            f"protocol (one_pass runs {', '.join(one_pass_policies())})")


@dataclass
class BudgetedPolicy(KVPolicy):
    """Shared by the sparse policies: a KV budget as a fraction of the tokens, or an absolute token count."""

    budget: float = 0.3
    budget_tokens: int | None = None
    small_example: ClassVar[dict] = {"budget": 0.3}
    keeps_all_example: ClassVar[dict] = {"budget": 1.0}

    def __post_init__(self):
        if not 0 < self.budget <= 1:
            raise UserError(f"budget must be in (0, 1], got {self.budget}")
        if self.budget_tokens is not None and self.budget_tokens < 1:
            raise UserError(f"budget_tokens must be >= 1, got {self.budget_tokens}")

    def tokens_allowed(self, tokens: int) -> int:
        """The budget in tokens per KV head, for a row of `tokens` tokens: the one rule every sparse policy uses."""
        return tokens_allowed(self.budget, self.budget_tokens, tokens)


def tokens_allowed(budget: float, budget_tokens: int | None, tokens: int) -> int:
    """A budget in tokens per KV head for a row of `tokens` tokens: `budget_tokens`, else the share `budget` of them
    (at least one)."""
    if budget_tokens is not None:
        return min(budget_tokens, tokens)
    return min(tokens, max(1, round(budget * tokens)))


def one_pass_policies() -> list[str]:
    """The registered policies with an official one-pass accuracy rule."""
    from kvlib.policies.registry import REGISTRY

    return sorted(name for name, cls in REGISTRY.items() if cls.one_pass_source)
