"""Serving under a request rate: arrivals drawn as `vllm bench serve` draws them, requests admitted when the clock
passes their arrival, and latencies, throughputs and goodput from the tokens' handover stamps."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvlib.engine import Engine
from kvlib.engine.arrivals import arrival_times
from kvlib.engine.run_result import TokenClock, latency_metrics
from kvlib.engine.scheduler import RunSettings, Sequence
from kvlib.errors import UserError
from kvlib.policies import make_policy


def test_arrivals_are_a_seeded_poisson_process_at_the_rate():
    times = arrival_times(4000, rate=8.0, seed=3)
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all() and times == arrival_times(4000, rate=8.0, seed=3)
    assert np.mean(gaps) == pytest.approx(1 / 8.0, rel=0.05)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.08)  # exponential gaps: CV 1


def test_burstiness_below_one_bunches_arrivals_at_the_same_rate():
    gaps = np.diff(arrival_times(4000, rate=8.0, burstiness=0.25, seed=3))
    assert np.mean(gaps) == pytest.approx(1 / 8.0, rel=0.1)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(2.0, rel=0.1)  # gamma of shape k: CV 1 / sqrt(k)
    assert arrival_times(3, rate=math.inf) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("n, rate, burstiness", [(0, 1.0, 1.0), (2, 0.0, 1.0), (2, 1.0, 0.0)])
def test_bad_arrival_settings_are_one_clear_error(n, rate, burstiness):
    with pytest.raises(UserError):
        arrival_times(n, rate, burstiness)


def test_latencies_and_goodput_from_handover_stamps(monkeypatch):
    """Request 0 arrives at 0 and gets tokens at 1, 2, 3 s; request 1 arrives at 1.5 and gets them at 2 and 3 s."""
    from kvlib.engine import run_result

    now = {"t": 10.0}
    monkeypatch.setattr(run_result.time, "perf_counter", lambda: now["t"])
    clock = TokenClock(2)
    clock.arrive(0, at=0.0), clock.arrive(1, at=1.5)
    for at, handed in ((1.0, [0]), (2.0, [0, 1]), (3.0, [0, 1])):
        now["t"] = 10.0 + at
        clock.handed(handed)
    m = latency_metrics(clock, slo_ttft_s=0.6)
    assert m["ttft_s_mean"] == pytest.approx(0.75) and m["ttft_s_p50"] == pytest.approx(0.75)
    assert (m["tpot_s_mean"], m["itl_s_mean"]) == (1.0, 1.0)
    assert m["e2e_s_p99"] == pytest.approx(3.0 - 0.01 * 1.5, abs=0.02)  # the percentiles interpolate: 1.5 and 3.0
    assert m["request_throughput"] == pytest.approx(2 / 3) and m["output_throughput"] == pytest.approx(5 / 3)
    assert m["goodput"] == pytest.approx(1 / 3)  # request 1 (TTFT 0.5 s) met the 0.6 s TTFT limit; request 0 did not
    assert m["max_running"] == 2
    assert latency_metrics(clock)["goodput"] is None  # no SLO, no goodput


def test_a_request_is_not_served_before_it_arrives(tiny):
    torch.manual_seed(0)
    prompts = [torch.randint(100, 5000, (n,)).tolist() for n in (30, 20, 25)]
    arrivals = [0.0, 0.0, 0.4]
    requests = [Sequence(p, 4, arrival_s=a) for p, a in zip(prompts, arrivals)]
    settings = RunSettings("continuous", "chunked", chunk_size=16, stop_at_eos=False, slo={"ttft_s": 10.0})
    served = Engine(tiny, make_policy("paged", block_size=4)).run(requests, settings)
    m = served.metrics
    assert m["e2e_s_mean"] >= m["ttft_s_mean"] > 0 and m["goodput"] == m["request_throughput"]
    assert m["request_throughput"] < 3 / 0.4  # the run lasted past the last arrival
    # served as they arrive: the same tokens as each request alone (greedy, full attention over its own cache)
    alone = [Engine(tiny, make_policy("paged", block_size=4)).generate([p], 4, stop_at_eos=False).outputs[0]
             for p in prompts]
    assert [o["token_ids"] for o in served.outputs] == [o["token_ids"] for o in alone]


@pytest.mark.model
def test_cli_serves_at_a_request_rate_and_reports_latency_percentiles(tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("The capital of France is")
    proc = subprocess.run([sys.executable, "-m", "kvlib", "run", "--policy", "paged", "--schedule", "continuous",
                           "--prefill", "chunked", "--request-rate", "20", "--num-requests", "3", "--max-new-tokens",
                           "3", "--ignore-eos", "--slo-ttft", "5", "--prompt-file", str(prompt), "--json"],
                          capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = json.loads(proc.stdout)["metrics"]
    for key in ("ttft_s_p50", "ttft_s_p90", "ttft_s_p99", "tpot_s_p50", "itl_s_p99", "e2e_s_p99",
                "request_throughput", "output_throughput", "goodput", "max_running", "preemptions"):
        assert metrics[key] is not None, key
    assert len(json.loads(proc.stdout)["outputs"]) == 3


@pytest.mark.parametrize("schedule", ["static", "continuous"])
def test_a_forked_request_that_ends_at_its_first_token_gives_its_row_back_as_any_other(tiny, schedule):
    """share_prompts under a serving schedule: a request whose prompt a running one holds forks its row and may end
    at that first token; it retires as every finished request does, its row given back at once (continuous), or at the
    end of the run (static: every row stays allocated until then)."""
    torch.manual_seed(0)
    a, b = torch.randint(100, 5000, (30,)).tolist(), torch.randint(100, 5000, (20,)).tolist()
    requests = [Sequence(a, 5), Sequence(a, 1), Sequence(b, 3), Sequence(a, 2)]
    result = Engine(tiny, make_policy("paged", block_size=4)).run(requests, RunSettings(schedule, "chunked",
                                                                  chunk_size=16, stop_at_eos=False, share_prompts=True))
    assert [len(o["token_ids"]) for o in result.outputs] == [5, 1, 3, 2]
    assert all(seq.status == "finished" for seq in requests)
    assert [seq.row >= 0 for seq in requests] == [schedule == "static"] * 4
