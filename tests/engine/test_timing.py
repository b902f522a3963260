"""One timing rule: exclusive sections, one definition of cache operations, a wall split that adds up."""

import time
import types

import pytest
import torch

from kvlib.engine import Engine
from kvlib.engine.run_result import CACHE_OPS, PHASE_SECTIONS, wall_split
from kvlib.memory.timing import Timers
from kvlib.policies import available, make_policy
from kvlib.study.kept import Kept


def test_nested_sections_count_once():
    timers = Timers(torch.device("cpu"))
    timers.phase = "decode"
    with timers.section("compute"):
        time.sleep(0.02)
        with timers.section("fetch"):
            time.sleep(0.03)
    assert timers.seconds["decode.fetch"] == pytest.approx(0.03, abs=0.01)
    assert timers.seconds["decode.compute"] == pytest.approx(0.02, abs=0.01)  # the fetch is not counted twice


def test_the_split_adds_up_and_cache_ops_are_the_named_sections():
    sections = {"setup.allocate": 9.0, "prefill.compute": 1.0, "prefill.eviction": 0.5, "decode.compute": 2.0,
                "decode.fetch": 0.25, "decode.selection": 0.25}
    split = wall_split(sections, prefill_s=1.6, decode_s=2.6, total_s=4.5)
    assert split == {"prefill": 1.0, "decode": 2.0, "cache_ops": 1.0, "other": 0.5}  # setup is outside total_s
    assert wall_split(None, 1.0, 2.0, 3.0) == {"prefill": 1.0, "decode": 2.0, "cache_ops": None, "other": None}


@pytest.mark.parametrize("name", available())
def test_every_policy_reports_sections_that_add_up_to_its_run(tiny, name):
    policy = make_policy(name)
    result = Engine(tiny, policy).generate([list(range(100, 160)), list(range(200, 230))], 6,
                                           prefill_mode=policy.preferred_prefill, stop_at_eos=False)
    m = result.metrics
    assert sum(m["wall_split_s"].values()) == pytest.approx(m["total_s"])
    assert m["wall_split_s"]["other"] >= -1e-6
    assert all(key.partition(".")[0] in ("setup", "prefill", "decode") for key in m["sections_s"])
    names = {key.partition(".")[2] for key in m["sections_s"]}
    assert names <= {*PHASE_SECTIONS, *CACHE_OPS}, names  # sections are named by what they are
    assert m["setup_s"] > 0 and m["ttft_s"] < m["total_s"]
    if name not in ("full", "flexgen"):  # (flexgen's cache wholly on the device, its default, is full's)
        assert m["wall_split_s"]["cache_ops"] > 0


def test_the_token_clock_reads_ttft_steps_and_decode_throughput_from_handovers(monkeypatch):
    """Two requests arriving at 0: first tokens handed over at 1 s and 3 s (their prefills), then three decode steps
    of both at 3.5, 4.0 and 5.0 s: TTFT 1 and 3 s, decode phase from 3 s to 5 s with 6 tokens (3 tok/s), steps of
    0.5, 0.5 and 1 s."""
    from kvlib.engine import run_result

    now = {"t": 100.0}
    monkeypatch.setattr(run_result.time, "perf_counter", lambda: now["t"])
    clock = run_result.TokenClock(2)
    clock.arrive(0), clock.arrive(1)
    for at, handed in ((1.0, [0]), (3.0, [1]), (3.5, [0, 1]), (4.0, [0, 1]), (5.0, [0, 1])):
        now["t"] = 100.0 + at
        clock.handed(handed)
    m = run_result.build_metrics(**clock.metrics(), sections=None)
    assert m["ttft_per_request_s"] == [1.0, 3.0] and m["step_latencies_s"] == [0.5, 0.5, 1.0]
    assert (m["prefill_s"], m["decode_s"], m["total_s"], m["decode_tokens"]) == (3.0, 2.0, 5.0, 6)
    assert m["decode_tokens_per_s"] == 3.0


def test_a_timed_run_follows_an_untimed_one_on_the_same_prompts_that_reads_memory(monkeypatch):
    """run_timed: the untimed run first (the one that reads memory and sections from inside an engine), then the
    timed one, which reads nothing; timings from the timed run, memory and the wall split from the untimed one."""
    from kvlib.study.experiments import common

    calls = []

    def fake_run(point, kept, prompts, n, *, memory_run):
        calls.append((len(prompts), n, memory_run))
        return types.SimpleNamespace(row=lambda: {
            "ttft_s": 9.0 if memory_run else 1.0, "decode_tokens_per_s": 1.0 if memory_run else 50.0,
            "device_peak_bytes": 7 if memory_run else None, "device_kv_bytes": 5 if memory_run else None,
            "split_cache_ops_s": 0.5 if memory_run else None, "oom": False, "oom_where": None})

    monkeypatch.setattr(common, "run", fake_run)
    kept = Kept()  # a fresh process's
    point = types.SimpleNamespace(weights="pretrained", key="p")
    row = common.run_timed(point, kept, [[1, 2]] * 8, 33)
    assert calls == [(8, 33, True), (8, 33, False)]
    assert (row["ttft_s"], row["decode_tokens_per_s"]) == (1.0, 50.0)
    assert (row["device_peak_bytes"], row["device_kv_bytes"], row["split_cache_ops_s"]) == (7, 5, 0.5)
    # another repeat of the point in this process: already warm on its shapes, timed at once, the same memory
    again = common.run_timed(point, kept, [[1, 2]] * 8, 33)
    assert calls[2:] == [(8, 33, False)] and again["device_peak_bytes"] == 7
    common.run_timed(types.SimpleNamespace(weights="pretrained", key="q"), kept, [[1, 2]] * 8, 33)
    assert calls[3:] == [(8, 33, True), (8, 33, False)]


def test_an_uninstrumented_engine_books_and_times_nothing_and_decodes_the_same(tiny):
    """What a timed kvlib run is: no ledger, no sections; the same tokens, memory reported as not measured."""
    from kvlib.engine import Engine
    from kvlib.policies import make_policy

    torch.manual_seed(0)
    prompts = [torch.randint(100, 5000, (n,)).tolist() for n in (40, 25)]
    measured = Engine(tiny, make_policy("h2o", budget=0.5)).generate(prompts, 6, prefill_mode="full", stop_at_eos=False)
    bare = Engine(tiny, make_policy("h2o", budget=0.5), device_capacity_bytes=1,
                  instrumented=False).generate(prompts, 6, prefill_mode="full", stop_at_eos=False)  # no capacity checked
    assert [o["token_ids"] for o in bare.outputs] == [o["token_ids"] for o in measured.outputs]
    assert bare.metrics["sections_s"] == {} and bare.memory["device"]["kv_bytes"] is None
    assert bare.memory["device"]["peak_bytes"] is None and bare.metrics["decode_tokens_per_s"] > 0
    assert measured.memory["device"]["kv_bytes"] > 0


def test_a_point_that_runs_out_of_memory_untimed_is_not_timed(monkeypatch):
    from kvlib.study.experiments import common

    calls = []

    def fake_run(point, kept, prompts, n, *, memory_run):
        calls.append(memory_run)
        return types.SimpleNamespace(row=lambda: {"ttft_s": None, "oom": True, "oom_where": "attention matrix"})

    monkeypatch.setattr(common, "run", fake_run)
    row = common.run_timed(types.SimpleNamespace(weights="pretrained", key="p"), Kept(), [[1, 2]], 1)
    assert calls == [True] and row["oom"] and row["oom_where"] == "attention matrix"
