"""The official accuracy harnesses' protocol: one dense pass per scored request, each query row masked by the policy.

H2O's lm-eval path (FMInference/H2O h2o_hf/utils_lm_eval) and InfiniGen's (snu-comparch/InfiniGen accuracy/) do not
prefill a context and then decode its continuation: they run lm-eval's log-likelihood request, context and
continuation together, as one forward pass of the model, and in every layer mask each query row's attention to the
keys the method's rule keeps for that row (`KVPolicy.one_pass_keep`). The budget then counts the whole sequence, the
context's rows are sparse as well as the continuation's, and nothing is stored. kvlib's deployed protocol
(kvlib.evaluation.lm) prefills the context densely and scores the continuation by decode steps through the policy's
cache, as a deployed system runs; the accuracy experiment reports both, each named in its rows (`protocol`).

The pass is transformers' forward of the model; its attention goes through kvlib's registered function, which masks
each layer by the policy's rule when `one_pass=(policy, counter)` is passed (kvlib.kernels.attention's
`masked_attention`). The share attended is counted
over the rows that score a continuation token: what each of them attended of the entries causally before it.
"""

from __future__ import annotations

import torch

from kvlib.errors import UserError
from kvlib.policies.base import one_pass_policies


class Counter:
    """Entries attended and entries causally visible, over the scored rows of every pass so far."""

    def __init__(self):
        self.attended = self.visible = 0
        self.rows: slice | None = None  # the current pass's scored query rows
        self.weight = 1  # the requests the current pass scores

    def add(self, keep: torch.Tensor) -> None:
        rows = keep[..., self.rows, :]
        self.attended += int(rows.sum()) * self.weight
        self.visible += int(torch.ones(rows.shape[-2:], dtype=torch.bool).tril(self.rows.start).sum()) * \
            rows.shape[0] * rows.shape[1] * self.weight

    @property
    def share(self) -> float | None:
        return self.attended / self.visible if self.visible else None


def check(policy) -> None:
    policy.check_one_pass()
    if getattr(policy, "budget_tokens", None) is not None:
        raise UserError("the one-pass protocol counts a budget as a share of the sequence (as the official harnesses "
                        "do); budget_tokens has no meaning there")


def score(loaded, policy, requests: list[tuple[list[int], list[int]]], counter: Counter | None = None
          ) -> list[tuple[float, bool]]:
    """(log-likelihood of the continuation, whether greedy decoding gives it) per (context, continuation) request,
    each one masked pass of context + continuation (left-truncated to the model's context, as lm-eval's `hf` model).

    Requests that feed the model the same tokens and score from the same row share one pass (a question's one-token
    choices, as BoolQ's " no" and " yes"), as lm-eval's `hf` model shares them: a pass is a function of its tokens,
    so each request's figures are those of a pass of its own, and the counter counts the shared pass once for each."""
    check(policy)
    passes: dict[tuple[tuple[int, ...], int], list[int]] = {}
    for i, (context, continuation) in enumerate(requests):
        if not continuation:
            raise UserError("lm-eval asked to score an empty continuation")
        whole = (context + continuation)[-(loaded.spec.max_context + 1):]
        first = len(whole) - 1 - len(continuation)  # the row that predicts the continuation's first token
        passes.setdefault((tuple(whole[:-1]), first), []).append(i)
    results: list[tuple[float, bool] | None] = [None] * len(requests)
    with torch.inference_mode(), policy.one_pass_session():
        for (fed, first), members in passes.items():
            ids = torch.tensor([fed], device=loaded.device)
            if counter is not None:
                counter.rows, counter.weight = slice(first, ids.shape[1]), len(members)
            logits = loaded.model(input_ids=ids, use_cache=False, one_pass=(policy, counter),
                                  logits_to_keep=ids.shape[1] - first).logits[0]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            for i in members:
                target = torch.tensor(requests[i][1], device=logprobs.device)
                results[i] = (float(logprobs.gather(-1, target[:, None]).sum()),
                              bool((logprobs.argmax(dim=-1) == target).all()))
    return results


__all__ = ["Counter", "one_pass_policies", "score"]
