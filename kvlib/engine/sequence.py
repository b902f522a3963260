"""One request as the scheduler's loop (kvlib.engine.scheduler) sees it: its prompt, what it generated, and where it
stands."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# where a request stands: not yet arrived; waiting for a row and room; its prompt being prefilled; decoding; waiting
# again, first in line, to be recomputed from its tokens after a preemption; done
STATUSES = ("pending", "waiting", "prefilling", "running", "preempted", "finished")


@dataclass
class Sequence:
    """One request: its prompt, what it generated, and where it stands (`status`, one of STATUSES)."""

    prompt: list[int]
    max_new_tokens: int
    arrival_step: int = 0
    arrival_s: float | None = None  # or when it arrives, in seconds from the start of the run (continuous schedule)
    forced: list[int] | None = None  # teacher forcing: the tokens fed instead of the model's own choices
    index: int = -1  # its place among the run's requests (outputs, the token clock)
    row: int = -1  # the cache row it holds while admitted (-1: none)
    status: str = "pending"
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    greedy: list[bool] = field(default_factory=list)
    compressions: int = 0  # how many times the compress schedule compacted its cache (a compressed one still runs)

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
