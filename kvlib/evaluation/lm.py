"""`kvlib` as an lm-eval model: every request runs through kvlib's engine under one KV policy and budget.

    lm_eval --model kvlib --model_args pretrained=smollm2-135m,policy=h2o,budget=0.1 --tasks piqa

A scored continuation is teacher-forced through decode steps (`Engine.generate(forced=...)`): the context but its last
token is prefilled, the policy compacts or offloads it as it would after any prompt, and every continuation token is
then predicted by a decode step that sees only what the budget lets the policy keep or fetch. (Scoring the first
continuation token straight from the prefill would see the whole context, and a one-token answer such as BoolQ's
"yes" would never feel the budget.) Requests that share a context share one prefill: the policy forks the row.

`prefill_store` (a kvlib.engine.prefill_record.PrefillStore): every prefill, scored or generated, is adopted from the
store's record of its prompt where the policy adopts one, so models of several policies given the same store compute
each item's dense prefill once between them (the accuracy experiment gives every point of a model one store). Each
item's result is the one without a store (tests/engine/test_adopted_prefill.py).
"""

from __future__ import annotations

import json

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from kvlib.engine import Engine
from kvlib.errors import UserError
from kvlib.evaluation import one_pass
from kvlib.evaluation.generation import answer_rows, check_protocol
from kvlib.models import load_model
from kvlib.policies import make_policy
from kvlib.policies.infinigen_coverage import means as coverage_means
from kvlib.settings import ONE_PASS


@register_model("kvlib")
class KVLibLM(TemplateLM):
    def __init__(self, pretrained: str = "smollm2-135m", policy: str = "full", batch_size: int | str = 8,
                 device: str | None = None, max_length: int | None = None, loaded=None,
                 calibration: list[int] | None = None, protocol: str = "deployed", prefill_store=None,
                 prefill: str | None = None, **policy_settings):
        """protocol: where generated answers' first token comes from (kvlib.evaluation.generation), scored
        continuations then coming from decode steps; or `one_pass` (kvlib.evaluation.one_pass): scored requests as the
        official harnesses run them, one masked pass each (log-likelihood tasks only). prefill_store: prefills shared
        with other models (above). prefill: the prefill mode of every prompt (the policy's preferred one by
        default)."""
        super().__init__()
        self.protocol = protocol if protocol == ONE_PASS else check_protocol(protocol)
        kv_policy = make_policy(policy, **policy_settings)  # bad settings fail here, before the model is loaded
        if protocol == ONE_PASS:
            one_pass.check(kv_policy)
        self.prefill_mode = prefill or kv_policy.preferred_prefill
        kv_policy.check_prefill(self.prefill_mode)
        self.loaded = loaded or load_model(pretrained, device=device)
        self.tokenizer = self.loaded.tokenizer
        self.batch_size = 8 if batch_size in (None, "auto") else int(str(batch_size).split(":")[0])
        self._max_length = max_length or self.loaded.spec.max_context
        self.engine = Engine(self.loaded, kv_policy, calibration=calibration)
        self.prefill_store = prefill_store
        self.tokens_attended = self.tokens_seen = 0  # by decode steps, over every request so far
        self.bytes_held: int | None = 0  # device KV bytes after each decode step, and the tokens seen then
        self.tokens_held = 0
        self.speculation = [0, 0.0, 0.0]  # InfiniGen's measure_coverage: samples, speculated mass, oracle mass
        self.one_pass = one_pass.Counter()  # what the one-pass protocol's scored rows attended

    def _generate(self, prompts, max_new_tokens, **kwargs):
        result = self.engine.generate(prompts, max_new_tokens, prefill_mode=self.prefill_mode,
                                      prefill_store=self.prefill_store, **kwargs)
        self._count(result.stats)
        return result

    def _count(self, usage: dict) -> None:
        """Add a run's KV usage (KVUsage.summary) to this model's totals."""
        self.tokens_attended += usage.get("kv_tokens_attended_total", 0)
        self.tokens_seen += usage.get("kv_tokens_seen_total", 0)
        held = usage.get("kv_device_bytes_held_total")
        self.bytes_held = None if held is None or self.bytes_held is None else self.bytes_held + held
        self.tokens_held += usage.get("kv_tokens_held_total") or 0
        if usage.get("speculation_samples"):
            for i, key in enumerate(("speculation_samples", "speculation_mass_sum", "oracle_mass_sum")):
                self.speculation[i] += usage[key]

    @property
    def speculation_columns(self) -> dict:
        """InfiniGen with measure_coverage, over every request so far: the true attention mass its speculated picks
        carried, the mass the oracle's best picks of the same count would have, and their ratio (its recall)."""
        return coverage_means(*self.speculation) if self.speculation[0] else {}

    @property
    def kv_share_attended(self) -> float | None:
        """The share of the KV cache decode steps attended, over every request scored so far (what the policy
        actually used, whatever its budget setting); under one_pass, what the scored rows' masks kept of the entries
        before each (kvlib.evaluation.one_pass.Counter)."""
        if self.protocol == ONE_PASS:
            return self.one_pass.share
        return self.tokens_attended / self.tokens_seen if self.tokens_seen else None

    @property
    def kv_device_bytes_per_token(self) -> float | None:
        """The device KV bytes held per token seen, over every decode step so far (KVUsage): what the policy held,
        whatever its budget setting."""
        return self.bytes_held / self.tokens_held if self.bytes_held is not None and self.tokens_held else None

    # -- what TemplateLM needs -------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        # as lm-eval's `hf` model: BOS where the tokenizer has one, so per-item scores compare one to one
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None:
            return self.tokenizer.encode(string)
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        if self.protocol == ONE_PASS:
            pairs = [(context, continuation) for _, context, continuation in requests]
            return one_pass.score(self.loaded, self.engine.policy, pairs, self.one_pass)
        scored = [self._split(context, continuation) for _, context, continuation in requests]
        # same contexts next to each other, so that a batch forks one prefill for all of a question's choices
        order = sorted(range(len(scored)), key=lambda i: (len(scored[i][0]), scored[i][0]))
        results: list[tuple[float, bool] | None] = [None] * len(scored)
        for begin in tqdm(range(0, len(order), self.batch_size), disable=disable_tqdm, desc="kvlib loglikelihood"):
            batch = order[begin:begin + self.batch_size]
            prompts = [scored[i][0] for i in batch]
            forced = [scored[i][1] for i in batch]
            result = self._generate(prompts, 0, forced=forced, share_prompts=True)
            for i, out in zip(batch, result.outputs):
                skip = scored[i][2]
                results[i] = (sum(out["logprobs"][skip:]), all(out["greedy"][skip:]))
        return results

    def _split(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int], int]:
        """(prompt, forced tokens, how many leading forced tokens are context, not scored)."""
        if not continuation:
            raise UserError("lm-eval asked to score an empty continuation")
        whole = (context + continuation)[-self.max_length:]  # left-truncated, as lm-eval's `hf` model does
        cut = len(whole) - len(continuation)
        if cut >= 2:  # the context's last token goes through a decode step, so the first scored token feels the budget
            return whole[:cut - 1], whole[cut - 1:], 1
        return whole[:max(cut, 1)], whole[max(cut, 1):], 0

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(text)
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append(((None, None), context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[owner] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy answers, batch_size requests at a time through one Session (kvlib.evaluation.generation, under this
        model's protocol): requests with the same generation settings together, longest prompts first; each answer
        as the request alone would get it (tested)."""
        if self.protocol == ONE_PASS:
            raise UserError("the one-pass protocol scores log-likelihood tasks (the official harnesses' accuracy "
                            "path); a generated answer runs under deployed or strict")
        asked = [self._request(req) for req in requests]
        order = sorted(range(len(asked)), key=lambda i: (json.dumps(asked[i][1:], default=str), -len(asked[i][0])))
        batches = [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        answers: list[str | None] = [None] * len(asked)
        for batch in tqdm(batches, disable=disable_tqdm, desc="kvlib generate_until"):
            by_settings: dict[str, list[int]] = {}
            for i in batch:  # a batch may straddle two settings: each runs apart
                by_settings.setdefault(json.dumps(asked[i][1:], default=str), []).append(i)
            for group in by_settings.values():
                for i, text in zip(group, self._answer([asked[i][0] for i in group], *asked[group[0]][1:])):
                    answers[i] = text
        return answers

    def _request(self, req) -> tuple[list[int], int, tuple[str, ...]]:
        """(prompt tokens, answer cap, stop strings) of a generate_until request."""
        context, gen_kwargs = req.args
        until = gen_kwargs.get("until") or [self.tokenizer.decode([self.eot_token_id])]
        until = (until,) if isinstance(until, str) else tuple(until)
        max_new = int(gen_kwargs.get("max_gen_toks", 256))
        return self.tok_encode(context)[-(self.max_length - max_new):], max_new, until

    def _answer(self, prompts: list[list[int]], max_new: int, until: tuple[str, ...]) -> list[str]:
        engine, mode = self.engine, self.prefill_mode
        for prompt in prompts:
            engine.validate([prompt], max_new, mode, 512)
        with engine.session([len(p) for p in prompts], max_new) as session:
            tokens = answer_rows(session, list(range(len(prompts))), prompts, max_new, self.protocol, mode,
                                 eos=self.eot_token_id, prefill_store=self.prefill_store)
            self._count({**engine.policy.usage.summary(), **engine.policy.stats()})  # (stats: InfiniGen's coverage)
        return [_cut(self.tokenizer.decode(t, skip_special_tokens=True), until) for t in tokens]


def _cut(text: str, until: tuple[str, ...]) -> str:
    for stop in until:
        text = text.split(stop)[0] if stop else text
    return text
