"""One timing rule: exclusive sections, one definition of cache operations, a wall split that adds up."""

import time
import types

import pytest
import torch

from kvlib.engine import Engine
from kvlib.engine.run_result import CACHE_OPS, wall_split
from kvlib.memory.timing import Timers
from kvlib.policies import available, make_policy


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
    assert names <= {"allocate", "compute", *CACHE_OPS}, names  # sections are named by what they are
    assert m["setup_s"] > 0 and m["ttft_s"] < m["total_s"]
    if name != "full":
        assert m["wall_split_s"]["cache_ops"] > 0


def test_the_systems_experiments_measure_decode_from_outside_the_engine(monkeypatch):
    """batch_scaling and decode_length time whole runs with 1 and N new tokens (after an untimed warm-up), as
    bench_decode.py does: decode tok/s = (N - 1) x rows / (wall(N) - wall(1)), whatever the engine says of itself."""
    from kvlib.engine.run_result import RunResult
    from kvlib.study.experiments import common

    clock = {"now": 0.0}
    calls = []

    def fake_run(point, prompts, n):  # 2 s of setup and prefill, then 0.1 s per decode step; the first 1-token
        calls.append((len(prompts), n))  # timing stalls for 9 s
        clock["now"] += 2.0 + 0.1 * (n - 1) + (9.0 if calls.count((len(prompts), 1)) == 1 and n == 1 else 0.0)
        metrics = {"decode_tokens_per_s": 999.0, "decode_tokens_per_s_q1": 900.0, "decode_tokens_per_s_q3": 1e3}
        return RunResult(outputs=[], metrics=metrics, memory={}, policy={}, stats={}, oom=None)

    monkeypatch.setattr(common, "run", fake_run)
    monkeypatch.setattr(common.time, "perf_counter", lambda: clock["now"])
    point = types.SimpleNamespace(weights="pretrained")
    row = common.run_measured_from_outside(point, [[1, 2]] * 8, 33)
    # the warm-up on the same prompts, then the two timed runs twice, alternating
    assert calls == [(8, 2)] + [(8, 1), (8, 33)] * common.OUTSIDE_TIMINGS
    assert row["decode_tokens_per_s"] == pytest.approx(32 * 8 / 3.2)  # 80 tok/s, not the engine's 999
    assert row["engine_decode_tokens_per_s"] == 999.0 and row["decode_tokens_per_s_q1"] is None
    assert (row["wall_1_token_s"], row["wall_s"]) == pytest.approx((2.0, 5.2))
