"""What a forward pass carries, for the model, the policies and the engine alike: the pass itself (Step), and a pass
of a recorded dense prefill as a policy adopts it (RecordedPass, over its PrefillRecord).

They live here, below the policies and the engine, because both sides read them and neither owns them: the engine
makes Steps and records prefills (kvlib.engine), a policy reads them (kvlib.policies.base), and kvlib's forward
(kvlib.models.llama_forward) already reads a Step's rows and parts. Whatever attends a pass is any object with an
`attend` method (`Attends`): a KV policy, or the recording pass that stands in for one
(kvlib.engine.prefill_record)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch


class Attends(Protocol):
    """What a Step hands each layer's attention to: it stores the new keys/values and returns the output."""

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, step: Step
               ) -> torch.Tensor: ...


@dataclass
class Step:
    """One forward pass as the policy sees it. A prefill pass with start > 0 extends a row that already holds tokens
    (a later chunk of its prompt, or the next turn of a conversation after decoding)."""

    policy: Attends
    rows: torch.Tensor  # [B] batch rows covered by this pass
    start: torch.Tensor  # [B] tokens each row already holds before this pass (= position of the first new token)
    q_len: int  # new tokens per row
    phase: str  # "prefill" or "decode"
    prefill_mode: str = "fused"
    last_chunk: bool = True  # the pass that ends a row's prompt
    end: torch.Tensor | None = None  # [B] each row's length once this prefill (all its chunks) is in
    # whether the pass's logits are read: not those of a chunk before its prompt's last, nor of a conversation's turn
    # fed with no question after it (the model's forward then skips its LM head, as vLLM does for a partial prefill)
    logits: bool = True
    # micro-batches: the pass cut into parts that kvlib's forward runs each layer on in turn (set by a policy's
    # prepare, FlexGen's zig-zag; kvlib.models.llama_forward), and a part's positions among its pass's rows
    parts: list[Step] | None = None
    index: torch.Tensor | None = None

    def split(self, keys: torch.Tensor) -> list[Step]:
        """The pass cut into parts, one per distinct key of its rows (keys [B]), in order of key."""
        parts = []
        for key in torch.unique(keys).tolist():
            index = torch.nonzero(keys == key).flatten()
            parts.append(Step(self.policy, self.rows[index], self.start[index], self.q_len, self.phase,
                              self.prefill_mode, self.last_chunk, None if self.end is None else self.end[index],
                              logits=self.logits, index=index))
        return parts

    def own(self, values: torch.Tensor) -> torch.Tensor:
        """A tensor over the pass's rows, [B, ...], cut to this part's rows (the whole of it for a whole pass)."""
        return values if self.index is None else values[self.index]

    @functools.cached_property
    def row_ends(self) -> list[tuple[int, int]]:
        """(row, its length once this pass is in) for each of the pass's rows: what a block-holding policy reserves."""
        return [(row, start + self.q_len) for row, start in zip(self.rows.tolist(), self.start.tolist())]

    @functools.cached_property
    def tokens_seen(self) -> int:
        """Tokens the step's rows hold once this pass is in, summed over the rows: what a full cache attends."""
        return int(self.start.sum()) + len(self.rows) * self.q_len


@dataclass
class PrefillRecord:
    """One prompt's dense prefill (kvlib.engine.prefill_record says what it holds and why)."""

    tokens: tuple[int, ...]
    arithmetic: str
    passes: tuple[tuple[int, int], ...]
    keys: list[torch.Tensor]  # per layer [Hkv, T, D], RoPE applied
    values: list[torch.Tensor]  # per layer [Hkv, T, D]
    queries: list[torch.Tensor]  # per layer [Hq, W, D]: the prompt's last W queries
    received: list[list[torch.Tensor]] | None  # matrix: per pass, per layer [Hkv, end of the pass]
    logits: torch.Tensor  # [V] fp32, after the last token

    @property
    def nbytes(self) -> int:
        tensors = [*self.keys, *self.values, *self.queries, self.logits]
        tensors += [r for per_pass in self.received or [] for r in per_pass]
        return sum(t.nbytes for t in tensors)

    def pass_of(self, index: int) -> RecordedPass:
        begin, length = self.passes[index]
        return RecordedPass(self, index, begin, length)


@dataclass
class RecordedPass:
    """One pass of a record, as KVPolicy.adopt_pass reads it: what attend's prefill branch would have been handed."""

    record: PrefillRecord
    index: int
    begin: int
    length: int

    def key(self, layer: int) -> torch.Tensor:
        """[1, Hkv, T, D]: the pass's keys, as attend receives them."""
        return self.record.keys[layer][None, :, self.begin:self.begin + self.length]

    def value(self, layer: int) -> torch.Tensor:
        return self.record.values[layer][None, :, self.begin:self.begin + self.length]

    def received(self, layer: int) -> torch.Tensor:
        """[Hkv, begin + T]: the attention each entry so far received from the pass's queries, summed over them and
        each KV head's query group (matrix arithmetic only)."""
        if self.record.received is None:
            raise ValueError("a record of the sdpa arithmetic holds no attention probabilities")
        return self.record.received[self.index][layer]

    def queries(self, layer: int) -> torch.Tensor:
        """[Hq, W, D]: the prompt's last W queries (W = the store's query_window, or the prompt if shorter)."""
        return self.record.queries[layer]
