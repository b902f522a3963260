"""The retention test (paper Sec. V-B, Fig. 8): is a fact told in the first turn still recalled turns later?

A conversation starts with a fact as the user's message and an assistant acknowledgement. Its exchanges are then fed
turn by turn into one engine row, with the policy's cache carried along (H2O evicts after every turn, for good). After
turns 2, 4, 6, ... a question about the fact is branched off: the policy forks the conversation's row into a second
row, the question is prefilled there and the answer generated greedily, and the conversation goes on in its own row
untouched. Correct = the answer states the expected value as whole words (`facts.answered`: "fig" is not found in
"config"), case and punctuation aside; answers may run to the longest statement of a fact plus a margin
(`facts.answer_cap`). The conversations' own assistant replies are fed (not
regenerated), so every policy sees the same context and differences come from cache management alone.

Conversations: LMSYS-Chat-1M through `datasets` (paper profile), or built offline from the CPython documentation.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvlib.engine import Engine
from kvlib.errors import UserError
from kvlib.evaluation.facts import Fact, answer_cap, answered, draw
from kvlib.evaluation.generation import answer_rows, check_protocol
from kvlib.models.workloads import corpus_ids

ACK = "Got it, I will remember that."
ASK = " Answer in a few words."


@dataclass
class Conversation:
    id: str
    fact: Fact
    exchanges: list[tuple[str, str]]  # (user, assistant) after the fact's own exchange
    bucket: tuple[int, int]  # [lo, hi) tokens of the whole conversation, the fact exchange included


def messages(conv: Conversation, turns: int | None = None) -> list[dict]:
    """The chat so far: the fact exchange, then the first `turns` exchanges."""
    out = [{"role": "user", "content": conv.fact.statement}, {"role": "assistant", "content": ACK}]
    for user, assistant in conv.exchanges[:turns]:
        out += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return out


def _render(tokenizer, chat: list[dict], ask: bool = False) -> str:
    return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=ask)


def _extension(tokenizer, before: list[dict], after: list[dict], ask: bool = False) -> list[int]:
    """Tokens the chat template adds going from one chat to a longer one (an exchange, or a question)."""
    head = _render(tokenizer, before) if before else ""
    full = _render(tokenizer, after, ask)
    if not full.startswith(head):
        raise UserError("the model's chat template does not render a conversation as a prefix of its continuation; "
                        "the retention test needs one that does")
    return tokenizer.encode(full[len(head):], add_special_tokens=False)


def conversation_tokens(tokenizer, conv: Conversation, turns: int | None = None) -> int:
    return len(tokenizer.encode(_render(tokenizer, messages(conv, turns)), add_special_tokens=False))


def bucket_label(bucket: tuple[int, int]) -> str:
    """[1024, 2048) -> "1K-2K", as the paper labels its buckets; [512, 1024) -> "512-1K"."""
    return "-".join(f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in bucket)


# -- conversations ---------------------------------------------------------------------------------------------------
def offline_conversations(tokenizer, buckets: list[list[int]], per_bucket: int, turns: int = 12, seed: int = 0
                          ) -> list[Conversation]:
    """Conversations about stretches of the CPython documentation, `per_bucket` per [lo, hi) token bucket."""
    rng = random.Random(seed)
    corpus = corpus_ids(tokenizer, max(hi for _, hi in buckets))
    convs = []
    for lo, hi in buckets:
        for index in range(per_bucket):
            per_side = (rng.randrange(lo, hi) - 60) // (2 * turns) - 20  # chat markup and phrasing take the rest
            exchanges = []
            for _ in range(turns):
                asked = _excerpt(tokenizer, corpus, per_side, rng)
                exchanges.append((f"Here is part of the Python documentation:\n\n{asked}\n\nWhat does it explain?",
                                  f"It explains the following.\n\n{_excerpt(tokenizer, corpus, per_side, rng)}"))
            convs.append(Conversation(f"pydoc-{len(convs)}", draw(rng, index), exchanges, (lo, hi)))
    return convs


def _excerpt(tokenizer, corpus: tuple[int, ...], tokens: int, rng: random.Random) -> str:
    start = rng.randrange(len(corpus) - tokens)
    return tokenizer.decode(corpus[start:start + tokens]).strip()


def dataset_conversations(tokenizer, source: dict, buckets: list[list[int]], per_bucket: int, min_turns: int = 2,
                          max_turns: int = 12, seed: int = 0, scan: int = 20000) -> list[Conversation]:
    """Conversations shaped like LMSYS-Chat-1M (`conversation`: [{role, content}, ...]) from a `datasets` source,
    English only, bucketed by their token length with the fact exchange; streamed, at most `scan` records read."""
    from kvlib.models.workloads import dataset_records

    rng = random.Random(seed)
    wanted = {tuple(b): per_bucket for b in buckets}
    convs = []
    for i, record in enumerate(dataset_records(source)):
        if i >= scan or not any(wanted.values()):
            break
        if record.get("language", "English") != "English":
            continue
        turns = record[source.get("field", "conversation")]
        pairs = [(u["content"], a["content"]) for u, a in zip(turns[::2], turns[1::2])
                 if u["role"] == "user" and a["role"] == "assistant"][:max_turns]
        if len(pairs) < min_turns:
            continue
        conv = _bucketed(tokenizer, str(record.get("conversation_id", i)), pairs, wanted, per_bucket, rng)
        if conv is not None:
            wanted[conv.bucket] -= 1
            convs.append(conv)
    return convs


def _bucketed(tokenizer, name: str, pairs, wanted: dict, per_bucket: int, rng: random.Random) -> Conversation | None:
    """The conversation in the first open bucket its length falls in, its fact the next of that bucket's sequence (so
    every bucket holds the same kinds of fact); None where it fits none."""
    for bucket, left in wanted.items():
        if not left:
            continue
        conv = Conversation(name, draw(random.Random(rng.random()), per_bucket - left), pairs, bucket)
        if bucket[0] <= conversation_tokens(tokenizer, conv) < bucket[1]:
            return conv
    return None


# -- the test ------------------------------------------------------------------------------------------------------
@dataclass
class _Plan:
    """A conversation as token pieces: its turns in order, and the question asked after each query turn."""

    conv: Conversation
    pieces: list[list[int]]
    asks: dict[int, list[int]]
    total: int  # the most tokens its rows hold: every turn, the longest question and its answer


def _plan(tok, conv: Conversation, query_turns: list[int], answer_tokens: int, max_context: int) -> _Plan:
    asked = [t for t in query_turns if t <= len(conv.exchanges)]
    pieces = [_extension(tok, [], messages(conv, 0))]
    pieces += [_extension(tok, messages(conv, t - 1), messages(conv, t)) for t in range(1, max(asked, default=0) + 1)]
    question = [{"role": "user", "content": conv.fact.question + ASK}]
    asks = {t: _extension(tok, messages(conv, t), messages(conv, t) + question, ask=True) for t in asked}
    total = sum(map(len, pieces)) + max(map(len, asks.values()), default=0) + answer_tokens
    if total > max_context:
        raise UserError(f"conversation {conv.id} needs {total} tokens; the model's context is {max_context}")
    return _Plan(conv, pieces, asks, total)


def run_conversation(engine: Engine, conv: Conversation, query_turns: list[int], prefill_mode: str,
                     chunk_size: int = 512, answer_tokens: int | None = None,
                     protocol: str | Sequence[str] = "deployed") -> list[dict]:
    """One conversation alone (run_conversations with one)."""
    return run_conversations(engine, [conv], query_turns, prefill_mode, chunk_size, answer_tokens, protocol)


def run_conversations(engine: Engine, convs: list[Conversation], query_turns: list[int], prefill_mode: str,
                      chunk_size: int = 512, answer_tokens: int | None = None,
                      protocol: str | Sequence[str] = "deployed") -> list[dict]:
    """Conversations in lockstep on one Session: each conversation in a row of its own, fed turn by turn; after a
    query turn each conversation's question is branched into one more row per protocol and all of them are answered
    together, every protocol's rows in the same decode steps (kvlib.evaluation.generation). One row per question and
    protocol; each answer is the one the conversation alone, under that protocol alone, would get (tested).

    Several protocols share one pass: the conversation's own row never sees a question, so its turns (the prefill
    that dominates the test's time) are the same under every protocol and are computed once. The KV usage in a row
    is its lockstep group's so far."""
    protocols = [protocol] if isinstance(protocol, str) else list(dict.fromkeys(protocol))
    for p in protocols:
        check_protocol(p)
    tok = engine.model.tokenizer
    answer_tokens = answer_tokens or answer_cap(tok)
    plans = [_plan(tok, conv, query_turns, answer_tokens, engine.model.spec.max_context) for conv in convs]
    stride = 1 + len(protocols)  # conversation c in row stride * c, its question under protocols[j] in the j + 1-th
    rows, held = [], [0] * len(plans)
    with engine.session([plan.total for plan in plans for _ in range(stride)], answer_tokens) as session:
        for turn in range(max(len(plan.pieces) for plan in plans)):
            for c, plan in enumerate(plans):
                if turn < len(plan.pieces):
                    session.prefill(stride * c, plan.pieces[turn], prefill_mode, chunk_size, logits=False)
                    held[c] += len(plan.pieces[turn])
            asked = [(j, c) for j in range(len(protocols)) for c, plan in enumerate(plans) if turn in plan.asks]
            for j, c in asked:
                session.fork(stride * c, stride * c + 1 + j)
            answers = answer_rows(session, [stride * c + 1 + j for j, c in asked],
                                  [plans[c].asks[turn] for _, c in asked], answer_tokens,
                                  [protocols[j] for j, _ in asked], prefill_mode, chunk_size, tok.eos_token_id)
            usage = engine.policy.usage.summary()
            for (j, c), answer in zip(asked, answers):
                conv, text = plans[c].conv, tok.decode(answer, skip_special_tokens=True)
                rows.append({"conversation": conv.id, "bucket": bucket_label(conv.bucket), "turn": turn,
                             "context_tokens": held[c], "fact": conv.fact.question, "expected": conv.fact.answer,
                             "answer": text, "correct": answered(conv.fact.answer, text),
                             "answer_tokens": answer_tokens, "protocol": protocols[j], **usage})
    return rows
