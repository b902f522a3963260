"""One prefill, every policy (kvlib.engine.prefill_record): a policy that adopts a recorded dense prefill ends where its
own prefill would, for every registered policy, at budgets that evict: the same greedy tokens, the same teacher-forced
log-probabilities (as lm-eval scores), the same ledger booking and policy statistics; a policy that cannot adopt runs
its own prefill, counted; the store counts hits and keeps to its byte cap. (The adopted results are bit for bit the
policy's own here; the tolerance is fp32 rounding, as the contract states.)"""

import dataclasses
import json

import pytest
import torch

from kvlib.engine import Engine
from kvlib.engine.prefill_record import PrefillStore, prefill_passes
from kvlib.errors import UserError
from kvlib.evaluation import KVLibLM
from kvlib.evaluation.tasks import evaluate, write_offline_tasks
from kvlib.policies import available, make_policy
from kvlib.policies.base import PREFILL_MODES
from kvlib.policies.registry import REGISTRY, policy_settings
from kvlib.policies.streaming import StreamingPolicy

# Settings that make each policy evict, select or quantize within these short prompts; a policy registered later
# runs with its defaults (at budget 0.3 where it has one), and runs its own prefill unless it declares adopts_prefill.
CASES = {
    "full": {},
    "paged": {"block_size": 8},
    "h2o": {"budget": 0.3},
    "infinigen": {"budget": 0.3},
    "streaming": {"budget": 0.3, "sink": 4},
    "snapkv": {"budget": 0.3, "window": 8},
    "kivi": {"bits": 2, "group_size": 8, "residual": 16},
    "quest": {"budget": 0.3, "block_size": 8},
    "duo": {"retrieval_ratio": 0.5, "sink": 4, "window": 8},  # half the heads staged and put in rings
    "adakv": {"budget": 0.3, "window": 8},
    "pyramidkv": {"budget": 0.3, "window": 8},
    # in 4 bits, as the accuracy grid runs it (on the device: placed, the transfers' times would differ run to run)
    "flexgen_h2o": {"budget": 0.3, "budget_rule": "seen", "compress_cache": True},
}
CHUNK = 16  # chunked prefill of these prompts takes two or three passes


def settings_of(name: str) -> dict:
    if name in CASES:
        return CASES[name]
    return {"budget": 0.3} if "budget" in policy_settings(name) else {}


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (48, 30)]


def modes_of(name: str) -> list[str]:
    policy = make_policy(name, **settings_of(name))
    modes = []
    for mode in PREFILL_MODES:
        try:
            policy.check_prefill(mode)
        except UserError:  # (the policy refuses this mode: H2O's fused)
            continue
        modes.append(mode)
    return modes


def generated(loaded, name, prompts, mode, store):
    """(greedy tokens, teacher-forced log-probabilities of a fixed continuation, the run's memory and statistics)."""
    engine = Engine(loaded, make_policy(name, **settings_of(name)))
    run = engine.generate(prompts, 6, prefill_mode=mode, chunk_size=CHUNK, stop_at_eos=False, prefill_store=store)
    forced = [list(range(100 + i, 105 + i)) for i in range(len(prompts))]
    scored = engine.generate(prompts, 0, prefill_mode=mode, chunk_size=CHUNK, forced=forced, prefill_store=store)
    return ([o["token_ids"] for o in run.outputs], [o["logprobs"] for o in scored.outputs], run.memory, run.stats,
            scored.memory, scored.stats)


def adopts(name: str, mode: str, prompts) -> bool:
    policy = make_policy(name, **settings_of(name))
    return all(policy.prefill_arithmetic(mode, len(prefill_passes(len(p), mode, CHUNK))) is not None for p in prompts)


def untimed(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if not k.endswith("_s")}


def same_booking(mine: dict, theirs: dict) -> None:
    """What the policy holds, now and at its peak; transient activations aside (an adopted prefill computes no
    attention, so its working buffers are not booked: kvlib.engine.prefill_record)."""
    for tier in ("device", "host"):
        assert mine[tier]["components"] == theirs[tier]["components"]
        for component in ("kv", "kv_reserved", "overhead", "weights"):
            assert mine[tier]["peak_components"][component] == theirs[tier]["peak_components"][component], (
                tier, component)


@pytest.mark.parametrize("name", available())
def test_adopted_prefill_generates_and_scores_as_the_policys_own(tiny, prompts, name):
    for mode in modes_of(name):
        own = generated(tiny, name, prompts, mode, None)
        store = PrefillStore()
        shared = generated(tiny, name, prompts, mode, store)  # the greedy run records (misses), the scored one hits
        assert shared[0] == own[0], (name, mode)
        for mine, theirs in zip(shared[1], own[1]):
            torch.testing.assert_close(torch.tensor(mine), torch.tensor(theirs), rtol=0, atol=1e-4)
        same_booking(shared[2], own[2])
        same_booking(shared[4], own[4])
        # policy statistics and KV usage, the seconds a copy thread timed aside (FlexGen's 4-bit coding, its flushes)
        assert untimed(shared[3]) == untimed(own[3]) and untimed(shared[5]) == untimed(own[5]), (name, mode)
        if adopts(name, mode, prompts):
            # two runs of two prompts: the first run's prompts are recorded, the second adopts them (paged's second
            # run on its engine starts from the blocks its prefix cache kept: its own prefill extends them, as
            # without a store)
            hits = 0 if name == "paged" else 2
            assert (store.misses, store.hits, store.own) == (2, hits, 0), (name, mode)
        else:
            assert (store.misses, store.hits, store.own) == (0, 0, 4), (name, mode)


def test_the_policies_of_an_accuracy_grid_adopt_and_kivi_chunked_runs_its_own(prompts):
    """Which policies adopt is what they declare: the dense-prefill ones in their preferred mode; KIVI's chunked
    prefill (later chunks attend the earlier ones dequantized) and StreamingLLM's cache positions over several
    chunks run their own."""
    for name in ("full", "paged", "h2o", "infinigen", "streaming", "snapkv", "quest", "kivi"):
        policy = make_policy(name)
        assert policy.prefill_arithmetic(policy.preferred_prefill, 1) is not None, name
    assert make_policy("h2o").prefill_arithmetic("chunked", 3) == "matrix"  # its scores read the probabilities
    assert make_policy("full").prefill_arithmetic("full", 1) == "matrix"
    assert make_policy("full").prefill_arithmetic("fused", 1) == "sdpa"
    assert make_policy("kivi").prefill_arithmetic("chunked", 2) is None
    cached = StreamingPolicy(position_scheme="cache")
    assert cached.prefill_arithmetic("chunked", 2) is None and cached.prefill_arithmetic("chunked", 1) == "sdpa"


def test_a_subclass_runs_its_own_prefill_unless_it_declares_adoption():
    """adopts_prefill is declared per class, never inherited: a new policy built on an adopting one (or on the
    scored-eviction mechanism) runs its own prefill by default, never an error."""
    @dataclasses.dataclass
    class Variant(REGISTRY["h2o"]):
        name = "h2o_variant_for_a_test"

    assert REGISTRY["h2o"].adopts_prefill and not Variant.adopts_prefill
    assert Variant().prefill_arithmetic("chunked", 1) is None
    for name in available():
        cls = REGISTRY[name]
        assert cls.adopts_prefill == ("adopts_prefill" in cls.__dict__ and cls.adopts_prefill)


def test_a_policy_that_runs_its_own_prefill_does(tiny, prompts, monkeypatch):
    """KIVI's chunked prefill over several chunks is its own: its attention runs, adopt_pass never does, the store
    records nothing and counts it."""
    policy_class = REGISTRY["kivi"]
    calls = {"attend": 0}
    attend = policy_class.attend

    def counting(self, layer, query, key, value, step):
        calls["attend"] += step.phase == "prefill"
        return attend(self, layer, query, key, value, step)

    def never(*args):
        raise AssertionError("adopt_pass ran for a policy that runs its own prefill")

    monkeypatch.setattr(policy_class, "attend", counting)
    monkeypatch.setattr(policy_class, "adopt_pass", never)
    store = PrefillStore()
    engine = Engine(tiny, make_policy("kivi", **CASES["kivi"]))
    engine.generate(prompts, 2, prefill_mode="chunked", chunk_size=CHUNK, prefill_store=store)
    passes = sum(len(prefill_passes(len(p), "chunked", CHUNK)) for p in prompts)
    assert calls["attend"] == passes * tiny.spec.num_layers
    assert (store.own, store.misses, store.hits, len(store)) == (2, 0, 0, 0)


def test_a_row_that_holds_tokens_runs_its_own_prefill(tiny, prompts):
    """A later turn extends what a row holds (here after eviction): no record describes that, so the policy's own
    prefill runs, and the first turn is still adopted."""
    results = []
    for store in (None, PrefillStore()):
        engine = Engine(tiny, make_policy("h2o", budget=0.3))
        with engine.session([len(prompts[0]) + len(prompts[1]) + 4], 4) as session:
            session.prefill(0, prompts[0], "chunked", CHUNK, prefill_store=store)
            logits = session.decode([0], [5])
            logits = session.prefill(0, prompts[1], "chunked", CHUNK, prefill_store=store)
            results.append((logits, engine.policy.kept_positions(1, 0)))
        if store is not None:
            assert (store.misses, store.hits, store.own) == (1, 0, 0)
    assert torch.equal(results[0][0], results[1][0]) and results[0][1] == results[1][1]


def test_adoption_reads_the_recorded_statistics(tiny, prompts):
    """The check above could not pass by accident: H2O adopting a record whose attention sums are altered keeps other
    tokens than its own prefill."""
    def kept(store):
        engine = Engine(tiny, make_policy("h2o", budget=0.3))
        with engine.session([len(prompts[0])], 1) as session:
            session.prefill(0, prompts[0], "full", prefill_store=store)
            return [engine.policy.kept_positions(layer, 0) for layer in range(tiny.spec.num_layers)]

    store = PrefillStore()
    assert kept(store) == kept(None)
    (record,) = store._records.values()
    with torch.inference_mode():  # (a record's tensors are inference tensors)
        for per_layer in record.received:
            for received in per_layer:
                received.copy_(received.flip(-1))
    assert kept(store) != kept(None)


def test_the_store_counts_hits_keys_by_model_and_keeps_to_its_byte_cap(tiny, smollm, prompts):
    engine = Engine(tiny, make_policy("full"))
    store = PrefillStore()
    first = store.get(engine, prompts[0], "sdpa", prefill_passes(len(prompts[0]), "fused", 512))
    assert store.get(engine, prompts[0], "sdpa", ((0, len(prompts[0])),)) is first
    assert (store.hits, store.misses) == (1, 1)
    # another arithmetic, other passes, another model object: other records
    store.get(engine, prompts[0], "matrix", ((0, len(prompts[0])),))
    store.get(engine, prompts[0], "sdpa", prefill_passes(len(prompts[0]), "chunked", CHUNK))
    assert (store.hits, store.misses, len(store)) == (1, 3, 3)
    assert first.nbytes > 0 and store.bytes == sum(r.nbytes for r in store._records.values())

    one = first.nbytes
    capped = PrefillStore(max_bytes=2 * one + one // 2)  # two records of this size fit, not three
    a = [0] + prompts[0][1:]
    b = [1] + prompts[0][1:]
    c = [2] + prompts[0][1:]
    passes = ((0, len(a)),)
    capped.get(engine, a, "sdpa", passes)
    capped.get(engine, b, "sdpa", passes)
    capped.get(engine, a, "sdpa", passes)  # a is now the more recently used
    capped.get(engine, c, "sdpa", passes)  # evicts b, the least recently used
    assert (capped.evictions, len(capped), capped.bytes <= capped.max_bytes) == (1, 2, True)
    capped.get(engine, a, "sdpa", passes)
    assert capped.hits == 2
    capped.get(engine, b, "sdpa", passes)
    assert capped.misses == 4
    with pytest.raises(ValueError, match="query_window"):
        PrefillStore(query_window=0)


def test_snapkv_with_a_window_wider_than_the_store_keeps_runs_its_own(tiny, prompts):
    store = PrefillStore(query_window=4)
    own = Engine(tiny, make_policy("snapkv", budget=0.3, window=8)).generate(prompts, 4, prefill_mode="fused")
    shared = Engine(tiny, make_policy("snapkv", budget=0.3, window=8)).generate(prompts, 4, prefill_mode="fused",
                                                                                prefill_store=store)
    assert [o["token_ids"] for o in own.outputs] == [o["token_ids"] for o in shared.outputs]
    assert (store.own, store.misses) == (2, 0)


def test_a_prefill_store_is_for_the_static_schedule(tiny, prompts):
    from kvlib.engine.scheduler import RunSettings, Sequence

    with pytest.raises(ValueError, match="static schedule"):
        Engine(tiny, make_policy("paged")).run([Sequence(prompts[0], 2)], RunSettings("continuous", "chunked",
                                               prefill_store=PrefillStore()))


def test_the_accuracy_path_with_a_shared_store_scores_each_item_as_without(tiny, tmp_path):
    """lm-eval through KVLibLM, several policies on one store (as the accuracy experiment's points share one): every
    item's scores are the ones each policy gets without it, and the store was hit. Generated answers (generate_until,
    RULER's path) likewise."""
    folder = write_offline_tasks(tiny.tokenizer, recall_lengths=[40, 120], recall_items=2, recall_choices=3,
                                 perplexity_docs_n=1, perplexity_tokens=48, seed=1)
    store = PrefillStore()
    texts = ["The capital of France is", "Once upon a time, in a land far away, there lived a dragon who guarded"]
    prompts = [tiny.tokenizer(t)["input_ids"] for t in texts]
    for name, settings in (("full", {}), ("h2o", {"budget": 0.3}), ("snapkv", {"budget": 0.3, "window": 8}),
                           ("kivi", CASES["kivi"])):
        rows = {}
        answers = {}
        for shared in (None, store):
            lm = KVLibLM(policy=name, loaded=tiny, prefill_store=shared, batch_size=4, **settings)
            rows[shared is None] = evaluate(lm, ["kvlib_recall"], include_path=folder)
            answers[shared is None] = [lm._answer([p], 6, ("\n\n",)) for p in prompts] + [
                lm._answer(prompts, 6, ("\n\n",))]
        assert len(rows[True]) == len(rows[False]) > 0
        for mine, theirs in zip(rows[False], rows[True]):
            assert {**mine, "choice_logliks": None} == {**theirs, "choice_logliks": None}, name
            assert json.loads(mine["choice_logliks"]) == pytest.approx(json.loads(theirs["choice_logliks"]),
                                                                         abs=1e-4)
        assert answers[True] == answers[False], name
        assert all(len(json.loads(r["choice_logliks"])) == 3 for r in rows[True])
    assert store.hits > 0 and store.own == 0


def test_one_prefill_mode_for_every_policy_records_an_item_once(tiny, tmp_path):
    """The accuracy experiment's `prefill: full`: every policy (H2O's matrix, the fused ones' too) adopts the same
    record of an item, so the store records each context once, not once per arithmetic; each policy's scores are
    still its own prefill's in that mode."""
    folder = write_offline_tasks(tiny.tokenizer, recall_lengths=[40], recall_items=2, recall_choices=3,
                                 perplexity_docs_n=1, perplexity_tokens=48, seed=1)
    policies = (("full", {}), ("h2o", {"budget": 0.3}), ("infinigen", {"budget": 0.3}), ("quest", {"budget": 0.3}))

    def misses(prefill):
        store = PrefillStore()
        for name, settings in policies:
            lm = KVLibLM(policy=name, loaded=tiny, prefill_store=store, batch_size=4, prefill=prefill, **settings)
            assert lm.prefill_mode == (prefill or make_policy(name).preferred_prefill)
            rows = evaluate(lm, ["kvlib_recall"], include_path=folder)
            alone = evaluate(KVLibLM(policy=name, loaded=tiny, batch_size=4, prefill=prefill, **settings),
                             ["kvlib_recall"], include_path=folder)
            assert [r["correct"] for r in rows] == [r["correct"] for r in alone], name
        return store.misses

    assert misses("full") == 2  # the two items' contexts
    assert misses(None) == 4  # H2O's matrix record and the others' fused one, per item
    with pytest.raises(UserError):
        KVLibLM(policy="flexgen_h2o", loaded=tiny, prefill="fused")  # it scores only under the full matrix
