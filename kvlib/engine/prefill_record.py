"""One prefill, every policy: a prompt's dense prefill recorded once and adopted by each policy whose prefill is it.

For most policies the prefill of a fresh row is the same dense computation: every layer's attention over the whole
prompt, causal, after which the policy stores the keys and values its own way (full, paged, Quest, InfiniGen: kept;
H2O, StreamingLLM, SnapKV: scored, then compacted; KIVI: quantized). An accuracy grid runs every policy on the same
items, so that computation is the same for all of them; here it is done once per item and each policy adopts it,
ending in exactly the state its own prefill would have: the same kept entries, scores, ledger booking and usage, and
the same logits after the last token.

What a record holds (kvlib.models.passes.PrefillRecord; a policy reads it a pass at a time, RecordedPass), the least
the adopting policies read:
- per layer the keys (RoPE applied, as policies receive them) and values of the whole prompt;
- per layer the prompt's last `query_window` queries (SnapKV's observation window votes with them at adopt, with
  its own window, kernel and pooling);
- for the `matrix` arithmetic, per pass and layer the attention each entry received, summed over the pass's queries
  and each KV head's query group (what H2O's prefill accumulates: it folds them at adopt by its own chunk_scoring);
- the logits after the last token.
Quest's block bounds, InfiniGen's skewed partial keys and KIVI's codes are functions of the keys and values: each
policy computes them at adopt by the code its prefill runs (KVPolicy.adopt_pass).

Who computes a record: a dense recording pass that belongs to no policy (`record_prefill`), not the first policy to
meet an item. So every policy, the first included, adopts by the same rule, a policy's own prefill is never also
the reference for the others, and whether an item was met before changes nothing a policy computes.

Exactness: the recording pass calls the attention an adopting policy's prefill calls (kvlib.kernels.attention) on the
same tensors, in the same passes (whole, or chunk by chunk for chunked prefill), so a record is keyed by its
arithmetic too: `sdpa` (fused or chunked prefill) or `matrix` (full prefill, and H2O, whose scoring reads the
probabilities), and by its passes. An adopted prefill is then bit for bit the policy's own (tests/
test_adopted_prefill.py). A policy whose prefill is not one dense pass runs its own (KVPolicy.prefill_arithmetic:
KIVI's chunked prefill attends the dequantized earlier chunks; a policy without `adopts_prefill`, the default for a
new one); so does a row that already holds tokens (a later turn, a prefix-cache hit). Session.prefill and
Engine.generate take a store (`prefill_store=`) and decide this themselves: a caller never needs to know.

A record is the store's memory, not a policy's: it is not booked in the run's ledger; the store's byte cap bounds it
(least recently used records go first). An adopted prefill books what the policy holds exactly as its own prefill
does; the transient working buffers of the attention it did not compute are not booked. Its time is the timer
sections `prefill.record` (the recording pass, on a miss) and `prefill.adopt`.
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections import OrderedDict

import torch

from kvlib.kernels.attention import causal_mask, matrix_attention, prefill_attention
from kvlib.memory.ledger import NoLedger
from kvlib.models.passes import PrefillRecord, Step

ARITHMETICS = ("sdpa", "matrix")


def prefill_passes(tokens: int, mode: str, chunk_size: int) -> tuple[tuple[int, int], ...]:
    """(offset, length) of each forward pass a prefill of `tokens` new tokens runs: chunks in chunked mode, else one."""
    size = chunk_size if mode == "chunked" else tokens
    return tuple((begin, min(size, tokens - begin)) for begin in range(0, tokens, size))


class _Recorder:
    """Stands in for a policy during the recording pass: the attention an adopting policy's prefill computes, over
    the prompt so far, and what a record keeps."""

    def __init__(self, spec, device, tokens: int, passes: int, arithmetic: str, query_window: int):
        shape = (spec.num_kv_heads, tokens, spec.head_dim)
        self.keys = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self.values = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self.queries: list[torch.Tensor | None] = [None] * spec.num_layers
        self.received = [[None] * spec.num_layers for _ in range(passes)] if arithmetic == "matrix" else None
        self.arithmetic, self.window, self.scale = arithmetic, query_window, spec.head_dim ** -0.5
        self.pass_index = 0
        self.ledger = NoLedger()  # the attention's working buffers are the recording pass's, booked nowhere

    def attend(self, layer, query, key, value, step: Step) -> torch.Tensor:
        begin, t = int(step.start[0]), step.q_len
        end = begin + t
        self.keys[layer][:, begin:end] = key[0]
        self.values[layer][:, begin:end] = value[0]
        k, v = self.keys[layer][None, :, :end], self.values[layer][None, :, :end]
        if self.arithmetic == "matrix":  # as full prefill, and H2O's prefill_attention_of
            out, probs = matrix_attention(query, k, v, causal_mask(t, end, query.device), self.scale)
            self.received[self.pass_index][layer] = probs[0].sum(dim=(1, 2))
        else:  # as fused and chunked prefill
            out = prefill_attention(query, k, v, begin, "fused", self.scale, self.ledger, layer)
        held = self.queries[layer]
        latest = query[0] if held is None else torch.cat([held, query[0]], dim=1)
        self.queries[layer] = latest[:, -self.window:].clone()  # a copy: not a view pinning the pass's queries
        return out


@torch.inference_mode()
def record_prefill(session, tokens: list[int], arithmetic: str, passes: tuple[tuple[int, int], ...],
                   query_window: int) -> PrefillRecord:
    """The dense prefill of `tokens` in `passes`, run on the session's model (timed as `prefill.record`)."""
    if arithmetic not in ARITHMETICS:
        raise ValueError(f"unknown prefill arithmetic {arithmetic!r}; choose from {list(ARITHMETICS)}")
    model = session.model
    recorder = _Recorder(model.spec, model.device, len(tokens), len(passes), arithmetic, query_window)
    end = torch.tensor([len(tokens)])
    logits = None
    with session.timers.section("record"):
        for index, (begin, length) in enumerate(passes):
            recorder.pass_index = index
            step = Step(recorder, torch.tensor([0]), torch.tensor([begin]), length, "prefill",
                        "full" if arithmetic == "matrix" else "fused", last_chunk=begin + length >= len(tokens),
                        end=end, logits=begin + length >= len(tokens))
            positions = step.start[:, None] + torch.arange(length)[None, :]
            logits = model.forward(torch.tensor([tokens[begin:begin + length]]), positions, step)
    return PrefillRecord(tuple(tokens), arithmetic, tuple(passes), recorder.keys, recorder.values, recorder.queries,
                         recorder.received, logits.float()[0])


def default_store_bytes() -> int:
    """A quarter of the machine's physical memory."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):
        return 4 * 2**30


class PrefillStore:
    """Prefill records keyed by the model (its identity: the same object, not the same name), the prompt's tokens,
    the arithmetic and the passes; at most `max_bytes` of them, the least recently used evicted first. Counts hits,
    misses (a recording pass ran), evictions, and the prefills of a fresh row that a policy ran itself because it
    adopts none there (`own`)."""

    def __init__(self, max_bytes: int | None = None, query_window: int = 64):
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if not isinstance(query_window, int) or query_window < 1:
            raise ValueError(f"query_window must be an integer >= 1, got {query_window!r}")
        self.max_bytes = default_store_bytes() if max_bytes is None else max_bytes
        self.query_window = query_window
        self._records: OrderedDict[tuple, PrefillRecord] = OrderedDict()
        self._models: dict[int, tuple[weakref.ref, int]] = {}
        self._serials = itertools.count()
        self.bytes = self.hits = self.misses = self.evictions = self.own = 0

    def _model_key(self, module: torch.nn.Module) -> int:
        """A number for this model object for as long as it lives (an id can be reused once it is gone)."""
        known = self._models.get(id(module))
        if known is None or known[0]() is not module:
            known = (weakref.ref(module), next(self._serials))
            self._models[id(module)] = known
        return known[1]

    def get(self, session, tokens: list[int], arithmetic: str, passes: tuple[tuple[int, int], ...]) -> PrefillRecord:
        """The record of this prompt on the session's model: the stored one (a hit), or a recording pass's (a miss)."""
        key = (self._model_key(session.model.model), tuple(tokens), arithmetic, tuple(passes))
        record = self._records.get(key)
        if record is not None:
            self.hits += 1
            self._records.move_to_end(key)
            return record
        self.misses += 1
        record = record_prefill(session, tokens, arithmetic, passes, self.query_window)
        self._records[key] = record
        self.bytes += record.nbytes
        while self.bytes > self.max_bytes and self._records:
            _, gone = self._records.popitem(last=False)
            self.bytes -= gone.nbytes
            self.evictions += 1
        return record

    def __len__(self) -> int:
        return len(self._records)

    def clear(self) -> None:
        self._records.clear()
        self.bytes = 0

    def stats(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions, "own_prefills": self.own,
                "records": len(self._records), "bytes": self.bytes, "max_bytes": self.max_bytes}
