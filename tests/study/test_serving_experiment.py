"""The serving experiment (issue 33): one trace per rate for every runner, replayed identically; a point runs end to
end into a row with every serving metric; a setup that does not fit is an OOM row; the report's rule for the highest
sustained rate, its tables and sentences, on synthetic frames with known answers."""

import math

import pandas as pd
import pytest
from chapter_rows import SYNTHETIC, serving_frame  # tests/helpers
from serving_cases import VALUES

from kvlib.report.serving import figures, sentences, sustained, tables
from kvlib.study.experiments import serving
from kvlib.study.kept import Kept
from kvlib.study.point import Point
from kvlib.study.runners import make_runner


def point(runner, capacity_gb=None, **values):
    settings = {"block_size": 4, **({"budget": 0.3} if runner == "h2o" else {})}
    if runner == "vllm":
        settings = {}
    return Point("serving", runner, make_runner(runner, **settings).settings(), {**VALUES, **values}, "tiny-llama",
                 device_capacity_gb=capacity_gb)


@pytest.fixture
def on_tiny(tiny, monkeypatch):
    """Points of the tiny random Llama: what a process keeps answers with the fixture for any model."""
    monkeypatch.setattr(Kept, "model", lambda self, *args, **kwargs: tiny)
    return tiny


def test_every_runner_at_a_rate_replays_one_trace(smollm):
    traces = {r: serving.trace_of(smollm.tokenizer, point(r).values) for r in ("paged", "h2o", "vllm")}
    assert len({t.sha for t in traces.values()}) == 1
    trace = traces["paged"]
    assert len(trace.prompts) == len(trace.output_tokens) == len(trace.arrivals_s) == 5
    assert all(20 <= len(p) <= 60 for p in trace.prompts) and all(3 <= n <= 6 for n in trace.output_tokens)
    assert len({len(p) for p in trace.prompts}) > 1  # lengths drawn, not one length repeated
    assert serving.trace_of(smollm.tokenizer, point("paged").values) == trace  # drawn again: the same


def test_between_rates_only_the_clock_changes(smollm):
    slow = serving.trace_of(smollm.tokenizer, {**VALUES, "request_rate": 1.0})
    fast = serving.trace_of(smollm.tokenizer, {**VALUES, "request_rate": 4.0})
    assert slow.prompts == fast.prompts and slow.output_tokens == fast.output_tokens
    assert all(math.isclose(a, 4 * b, abs_tol=1e-9) for a, b in zip(slow.arrivals_s, fast.arrivals_s))
    assert slow.sha != fast.sha


def test_a_trace_is_replayed_identically(on_tiny):
    p = point("paged")
    trace = serving.trace_of(on_tiny.tokenizer, p.values)
    first, second = (serving.serve(p, Kept(), trace, memory_run=m) for m in (True, False))
    assert [o["token_ids"] for o in first.outputs] == [o["token_ids"] for o in second.outputs]
    assert [len(o["token_ids"]) for o in first.outputs] == list(trace.output_tokens)  # EOS ignored, lengths drawn


def test_a_point_is_one_row_with_every_serving_metric(on_tiny):
    rows = serving.run_point(point("h2o", request_rate=100.0), Kept())
    assert len(rows) == 1
    row = rows[0]
    for column in (*serving.LATENCY_COLUMNS, "preemptions", "slo_attainment", "device_kv_peak_bytes",
                   "stat_peak_blocks_used", "trace_sha", "setup_s"):
        assert column in row, column
    assert not row["oom"] and row["device_kv_peak_bytes"] > 0 and row["max_running"] >= 1
    assert row["ttft_s_p99"] >= row["ttft_s_p50"] > 0 and row["slo_attainment"] == 1.0  # SLO far above the times


def test_a_setup_that_does_not_fit_is_an_oom_row(on_tiny):
    row, = serving.run_point(point("paged", capacity_gb=1e-4), Kept())
    assert row["oom"] and row["oom_where"] and row["ttft_s_p50"] is None


def test_vllm_is_asked_before_it_starts_whether_its_pool_holds_the_longest_request(on_tiny, monkeypatch):
    """vLLM refuses to start unless its pool holds one request of max_model_len (whole blocks of every layer): the
    experiment asks that rule first and records the OOM point without starting vLLM or reading its error text."""
    from kvlib.backends import vllm

    def started(*args, **kwargs):
        raise RuntimeError("vLLM started")

    monkeypatch.setattr(vllm, "_spec", lambda model: on_tiny.spec)
    monkeypatch.setattr(serving, "serve", started)
    trace = serving.trace_of(on_tiny.tokenizer, point("vllm").values)
    block = make_runner("vllm").block_size
    holds_one = on_tiny.spec.kv_bytes(-(-trace.longest // block) * block)
    monkeypatch.setattr(vllm, "_kv_space", lambda model, capacity: holds_one - 1)
    row, = serving.run_point(point("vllm"), Kept())
    assert row["oom"] and f"one request of {trace.longest} tokens" in row["oom_where"]
    monkeypatch.setattr(vllm, "_kv_space", lambda model, capacity: holds_one)
    with pytest.raises(RuntimeError, match="vLLM started"):
        serving.run_point(point("vllm", request_rate=51.0), Kept())


def test_a_kvlib_pool_that_cannot_hold_one_request_alone_is_an_oom_row(on_tiny, monkeypatch):
    """The scheduler finds, before a pass, that the pool cannot hold a request even with none other running
    (RequestTooLarge): the point is an OOM row; any other error of the replay is the point's error."""
    trace = serving.trace_of(on_tiny.tokenizer, point("paged").values)
    weights = on_tiny.weights_bytes + on_tiny.packed_copy_bytes
    room = (trace.longest // 2) * on_tiny.spec.kv_bytes_per_token  # half the longest request's KV
    capacity_gb = (weights + room) / 0.9 / 2**30
    row, = serving.run_point(point("paged", capacity_gb=capacity_gb, request_rate=52.0), Kept())
    assert row["oom"] and "even alone" in row["oom_where"] and row["ttft_s_p50"] is None

    def broken(*args, **kwargs):
        raise ValueError("something else")

    monkeypatch.setattr(serving, "serve", broken)
    with pytest.raises(ValueError, match="something else"):
        serving.run_point(point("paged", request_rate=53.0), Kept())


@pytest.mark.model
def test_a_smoke_point_runs_end_to_end_on_smollm2(tmp_path, monkeypatch):
    from kvlib import study
    from kvlib.study import executor, results

    monkeypatch.setenv("KVLIB_ROOT", str(tmp_path))
    (tmp_path / "params").mkdir()
    (tmp_path / "params" / "p.yaml").write_text(
        "model: smollm2-135m\nexperiments:\n  serving:\n    device_capacity_gb: 0.75\n    policies: [paged]\n"
        "    grid: {request_rate: [20.0]}\n    fixed: {num_requests: 2, min_prompt_tokens: 16, max_prompt_tokens: 32,"
        " min_output_tokens: 2, max_output_tokens: 3, chunk_size: 16, prefill: chunked, slo_ttft_s: 60.0,"
        " slo_tpot_s: 10.0}\n")
    executor.run_experiment(study.load_profile("p"), "serving", progress=False)
    df = results.load("p", "serving")
    assert len(df) == 1 and not df["oom"].any() and {"git_sha", "device_name", "repeat"} <= set(df)
    assert df["request_rate"].iloc[0] == 20.0 and df["goodput"].iloc[0] > 0


# ---- the report, on synthetic frames ---------------------------------------------------------------------------------

def test_the_highest_sustained_rate_is_measured_and_never_beyond_the_grid():
    rates = sustained.sustained_rates(SYNTHETIC)
    assert rates["paged"].rate == 1.0 and not rates["paged"].at_least  # 95 % passes, 50 % fails
    assert rates["h2o"].rate == 2.0 and rates["h2o"].at_least  # 90 % passes at the top: "at least"
    assert rates["h2o"].text() == "at least 2 requests/s"
    assert rates["quest"].rate is None and rates["quest"].text().startswith("below 0.5")  # not read past a failure
    assert rates["snapkv"].rate == 0.5  # out of memory at 1.0 stops it there, whatever 2.0 did
    assert rates["paged"].row["ttft_s_p99"] == pytest.approx(0.2)


def test_repeats_pass_on_their_median_share():
    repeats = serving_frame({("paged", 1.0): 0.95}).loc[[0, 0, 0]].assign(slo_attainment=[0.95, 0.5, 0.92])
    assert sustained.passes(repeats)
    assert not sustained.passes(repeats.assign(slo_attainment=[0.5, 0.5, 0.95]))


def test_the_tables_show_every_point_and_oom():
    table = tables.serving_table(SYNTHETIC)
    assert len(table) == 12
    assert (table.loc[("snapkv", "1")] == "OOM").all()  # (rates shown to 3 figures, as every cell)
    assert table.loc[("h2o", "2"), "within SLO"] == "0.9"
    views = tables.serving_views(SYNTHETIC)  # the same cells, in three narrower tables
    assert sorted(c for v in views.values() for c in v.columns) == sorted(table.columns)
    assert all(v.index.equals(table.index) for v in views.values())
    traces = tables.trace_table(SYNTHETIC.assign(trace_sha=SYNTHETIC["request_rate"].astype(str), prompt_tokens_total=99,
                                                 output_tokens_total=9, trace_span_s=3.0))
    assert traces.loc["one trace for all"].all() and (traces.loc["runners"] == 4).all()
    assert list(tables.trace_table(SYNTHETIC.assign(request_rate=SYNTHETIC["request_rate"] / 3, trace_sha="t",
                                                    prompt_tokens_total=99, output_tokens_total=9, trace_span_s=3.0)
                                   ).columns) == sorted({f"{r / 3:.3g}" for r in SYNTHETIC["request_rate"]}, key=float)
    closing = tables.sustained_table(SYNTHETIC)
    assert list(closing.index[:2]) == ["h2o", "paged"]  # the highest sustained rate first
    assert closing.loc["paged", "preemptions there"] == "0"  # at 1 request/s, where paged still sustains


def test_the_pool_line_is_vllms_rule_at_the_rows_capacity():
    rows = SYNTHETIC.assign(device_weights_peak_bytes=538060032, device_weights_packed_peak_bytes=113246208)
    assert figures.pool_mib(rows) == pytest.approx((0.9 * 0.75 * 2**30 - 651306240) / 2**20, abs=1e-3)
    assert figures.pool_mib(SYNTHETIC) is None  # no weights booked: no line


def test_the_sentences_say_whether_compression_bought_capacity():
    text = "\n".join(sentences.lines(SYNTHETIC))
    assert "at least 90% of the requests" in text
    assert ("h2o against paged at 2 requests/s: peak KV 20.0 against 64.0 MiB, up to 12 against 4 requests running, "
            "0 against 3 preemptions") in text
    assert "it sustains a grid rate above paged's (at least 2 requests/s against 1 requests/s)" in text
    assert "quest against paged" in text and "a grid rate below paged's" in text
    assert "measured once" in text


# ---- the chooser learns serving ----------------------------------------------------------------------------------------

def test_the_chooser_reads_who_meets_the_slo_at_a_rate_interpolated_never_extrapolated():
    from kvlib.report.choose.serving import choose_serving

    c = choose_serving(SYNTHETIC, pd.DataFrame(), 1.5, slo_ttft_s=0.3, slo_tpot_s=0.1)
    assert c.capacity_gb == 0.75
    assert c.meets["paged"]["ttft_s"].value == pytest.approx((1 / 6 + 2 / 6) / 2)  # between 1 and 2 requests/s
    assert c.meets["paged"]["ttft_s"].points == [1.0, 2.0]
    assert "snapkv" in c.excluded and "out of device memory" in c.excluded["snapkv"]  # OOM at 1.0, under the reading
    assert set(c.meets) == {"paged", "h2o", "quest"}
    at_two = choose_serving(SYNTHETIC, pd.DataFrame(), 2.0, slo_ttft_s=0.3)
    assert "paged" in at_two.misses and "> 0.3 s" in at_two.misses["paged"]
    beyond = choose_serving(SYNTHETIC, pd.DataFrame(), 4.0, slo_ttft_s=10.0)
    assert not beyond.meets and "not extrapolated" in beyond.excluded["paged"]
    below = choose_serving(SYNTHETIC, pd.DataFrame(), 0.1, slo_ttft_s=10.0)
    assert below.meets["paged"]["ttft_s"].at == 0.5 and "below the lowest rate measured" in below.text()


def test_the_serving_chooser_keeps_to_the_memory_and_accuracy_asked():
    from kvlib.report.choose.serving import choose_serving

    assert not choose_serving(SYNTHETIC, pd.DataFrame(), 1.0, 1.0, device_memory_gb=0.5).meets  # measured at 0.75
    assert choose_serving(SYNTHETIC, pd.DataFrame(), 1.0, 1.0, device_memory_gb=2.0).meets  # more memory: more blocks
    strict = choose_serving(SYNTHETIC, pd.DataFrame(), 1.0, 1.0, max_accuracy_drop=1.0)
    assert set(strict.meets) == {"paged"}  # lossless; the others' accuracy was not measured
    assert strict.excluded["h2o"] == "its accuracy was not measured in this profile on a task the full cache passes"
    assert "keeps every entry" in strict.text()


def test_kvlib_choose_answers_a_request_rate(tmp_path, monkeypatch, capsys):
    from kvlib import cli
    from kvlib.study import results

    monkeypatch.setenv("KVLIB_ROOT", str(tmp_path))
    (tmp_path / "params").mkdir()
    (tmp_path / "params" / "p.yaml").write_text("model: smollm2-135m\nexperiments: {}\n")
    results.write_unit("p", "serving", "k", 0, SYNTHETIC)
    assert cli.main(["choose", "--profile", "p", "--request-rate", "1.5", "--slo-ttft", "0.3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("At 1.5 requests/s with p90 TTFT <= 0.3 s (serving results at 0.75 GiB):")
    assert "Meet it: " in out and "Not read: snapkv" in out
    assert cli.main(["choose", "--profile", "p", "--slo-ttft", "0.3"]) == 2  # a workload or a rate


def test_a_rate_multiple_runs_at_a_multiple_of_this_machines_service_rate(on_tiny, tmp_path, monkeypatch):
    """`rate_multiple`: paged serves the whole trace at once to measure the machine's service rate, once (kept in
    kvlib's cache), and every runner's point runs at the multiple of it, its row saying which rate that was."""
    monkeypatch.setenv("KVLIB_CACHE", str(tmp_path))
    values = {k: v for k, v in VALUES.items() if k != "request_rate"}
    probes = []
    replay = serving._replay
    monkeypatch.setattr(serving, "_replay", lambda p, kept, t, memory_run: probes.append(p.runner) or replay(
        p, kept, t, memory_run=memory_run))
    rows = serving.run_point(point("h2o", **values, rate_multiple=2.0), Kept())
    rate = rows[0]["service_rate"]
    assert probes[0] == "paged" and rate > 0
    assert rows[0]["request_rate"] == pytest.approx(2 * rate)
    probes.clear()
    again = serving.run_point(point("paged", **values, rate_multiple=0.5), Kept())
    assert len(probes) == 2  # the point's instrumented and timed replays: the probe was read, not run again
    assert again[0]["service_rate"] == rate and again[0]["request_rate"] == pytest.approx(rate / 2)
    assert (tmp_path / serving.SERVICE_RATE_FILE).exists()
