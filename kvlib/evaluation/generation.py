"""Greedy answers for several rows of one Session at once, under a stated protocol: where the budget acts.

- `deployed`: each prompt (a RULER item, a retention question) is prefilled whole and the first answer token comes
  from that prefill, as the systems serve a new turn. A policy that selects only in decode (InfiniGen, Quest) then
  reads the whole history for that token; one that evicts (H2O) reads only what it kept.
- `strict`: every prompt but its last token is prefilled, and that last token goes through a decode step together
  with the other rows': every answer token, the first included, comes from a decode step that sees only what the
  budget lets the policy keep or fetch (as lm-eval's scored continuations always are, `kvlib.evaluation.lm`).

Rows are prefilled one at a time and then decoded together until each reaches its cap or EOS (a finished row leaves
the batch), the engine's static schedule; a row's answer does not depend on the other rows (tested).
"""

from __future__ import annotations

from kvlib.errors import UserError
from kvlib.settings import DECODED, STRICT


def check_protocol(protocol: str) -> str:
    if protocol not in DECODED:
        raise UserError(f"unknown protocol {protocol!r}; choose from {list(DECODED)}")
    return protocol


def split_prompt(prompt: list[int], protocol: str) -> tuple[list[int], list[int]]:
    """(tokens to prefill, the token a decode step feeds first): strict keeps the last token for a decode step."""
    if check_protocol(protocol) == STRICT and len(prompt) >= 2:
        return prompt[:-1], prompt[-1:]
    return prompt, []


def answer_rows(session, rows: list[int], prompts: list[list[int]], max_new_tokens: int,
                protocol: str | list[str], prefill_mode: str, chunk_size: int = 512, eos: int | None = None,
                prefill_store=None) -> list[list[int]]:
    """Extend each row by its prompt, then answer greedily in lockstep; returns each row's answer tokens.
    protocol: one for every row, or each row's own (rows under both protocols then share their decode steps: a
    strict row's first step feeds its prompt's last token while a deployed row's feeds its first answer token).
    prefill_store: a kvlib.engine.prefill_record.PrefillStore whose records the policy adopts (Session.prefill)."""
    protocols = [protocol] * len(rows) if isinstance(protocol, str) else list(protocol)
    if len(protocols) != len(rows):
        raise ValueError(f"{len(protocols)} protocols for {len(rows)} rows")
    answers: dict[int, list[int]] = {row: [] for row in rows}
    tails: dict[int, int] = {}
    for row, prompt, row_protocol in zip(rows, prompts, protocols):
        head, tail = split_prompt(prompt, row_protocol)
        logits = session.prefill(row, head, prefill_mode, chunk_size, prefill_store=prefill_store, logits=not tail)
        if tail:
            tails[row] = tail[0]
        else:
            answers[row].append(int(logits.argmax()))
    answering = _unfinished(answers, max_new_tokens, eos)  # deployed rows: their first tokens came from the prefills
    fed = {row: tails[row] if row in tails else answering[row] for row in rows if row in tails or row in answering}
    while fed:
        for row, logits in zip(fed, session.decode(list(fed), list(fed.values()))):
            answers[row].append(int(logits.argmax()))
        fed = _unfinished(answers, max_new_tokens, eos)
    return [answers[row] for row in rows]


def _unfinished(answers: dict[int, list[int]], max_new_tokens: int, eos: int | None) -> dict[int, int]:
    """Each row still answering, with the token its next decode step feeds."""
    return {row: answer[-1] for row, answer in answers.items()
            if answer and len(answer) < max_new_tokens and answer[-1] != eos}
