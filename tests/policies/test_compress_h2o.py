"""Compress instead of preempt (issue 45): the `compress_h2o` runner, H2O holding every entry, that serves under the
scheduler's `compress` schedule, never compressed below its budget (tests/policies/test_fidelity_compress.py); the
serving experiment replays it so and records whom it compressed and every request's output tokens; the serving
report reads what compression cost those requests against paged's tokens."""

import json

import pandas as pd
import pytest
from prompts import prompts_of
from serving_cases import VALUES, capacity_for

from kvlib.engine import Engine
from kvlib.engine.scheduler import RunSettings, Sequence
from kvlib.errors import UserError
from kvlib.policies import available, make_policy
from kvlib.report.serving import compression, sentences
from kvlib.study.experiments import serving
from kvlib.study.kept import Kept
from kvlib.study.point import Point
from kvlib.study.runners import make_runner, runner_class


def test_it_is_registered_and_declares_the_schedule_it_serves_under():
    assert "compress_h2o" in available()
    policy = make_policy("compress_h2o")
    assert policy.serving_schedule == "compress" and policy.budget == 0.3 and policy.compress_share == 0.5
    assert policy.label == "compress_h2o" and "instead of preempting" in policy.evicts
    for name in ("paged", "h2o", "full", "vllm"):  # everyone else: vLLM's continuous batching
        assert runner_class(name).serving_schedule == "continuous"
    for share in (0.0, 1.0, 1.5):
        with pytest.raises(UserError, match="compress_share"):
            make_policy("compress_h2o", compress_share=share)


def serve(tiny, schedule, share=None, **settings):
    policy = make_policy("compress_h2o", block_size=4, **settings)
    engine = Engine(tiny, policy, device_capacity_bytes=capacity_for(tiny, 110))
    settings = RunSettings(schedule, "chunked", chunk_size=16, stop_at_eos=False, compress_share=share)
    return engine.run([Sequence(p, 30) for p in prompts_of(40, 40, 36)], settings)


def test_the_compress_schedule_keeps_the_policys_share_unless_one_is_passed(tiny):
    for settings, share, kept in (({"compress_share": 0.25}, None, 0.25), ({"compress_share": 0.25}, 0.5, 0.5)):
        compressions = serve(tiny, "compress", share, **settings).stats["compressions"]
        assert compressions
        assert all(c["entries_after"] == max(1, round(kept * c["entries_before"])) for c in compressions)


def test_under_the_continuous_schedule_it_preempts_as_paged_does(tiny):
    result = serve(tiny, "continuous")
    assert result.metrics["preemptions"] > 0 and "compressions" not in result.stats


# ---- the serving experiment ------------------------------------------------------------------------------------------

TIGHT = {"num_requests": 4, "min_prompt_tokens": 30, "max_prompt_tokens": 50, "min_output_tokens": 24,
         "max_output_tokens": 30, "request_rate": 1000.0}  # every request at once, in a pool of about 110 tokens


def point(tiny, runner):
    settings = make_runner(runner, block_size=4).settings()
    capacity_gb = capacity_for(tiny, 110) / 2**30
    return Point("serving", runner, settings, {**VALUES, **TIGHT}, "tiny-llama", device_capacity_gb=capacity_gb)


@pytest.fixture
def on_tiny(tiny, monkeypatch):
    monkeypatch.setattr(Kept, "model", lambda self, *args, **kwargs: tiny)
    return tiny


def test_the_serving_experiment_compresses_where_paged_preempts_and_lists_whom(on_tiny):
    paged, = serving.run_point(point(on_tiny, "paged"), Kept())
    mine, = serving.run_point(point(on_tiny, "compress_h2o"), Kept())
    assert paged["preemptions"] > 0 and paged["compressions"] is None and paged["compressed_requests"] is None
    assert not mine["oom"] and mine["completed"] and mine["preemptions"] == 0
    trace = serving.trace_of(on_tiny.tokenizer, point(on_tiny, "paged").values)
    assert mine["trace_sha"] == paged["trace_sha"] == trace.sha
    for row in (paged, mine):  # every request served in full, its tokens in trace order
        assert [len(ids) for ids in row["output_token_ids"]] == list(trace.output_tokens)
    listed = mine["stat_compressions"]
    assert mine["compressions"] == len(listed) > 0
    assert mine["compressed_requests"] == sorted({c["request"] for c in listed})
    assert mine["requests_compressed"] == len(mine["compressed_requests"])
    assert mine["entries_kept_share"] == pytest.approx(
        sum(c["entries_after"] / c["entries_before"] for c in listed) / len(listed))
    assert 0.4 < mine["entries_kept_share"] < 0.6  # its compress_share, 0.5, of what a request held
    json.dumps([mine["output_token_ids"], mine["compressed_requests"], listed])  # JSON-able columns
    for index, (got, lossless) in enumerate(zip(mine["output_token_ids"], paged["output_token_ids"])):
        if index not in mine["compressed_requests"]:
            assert got == lossless  # whom it did not compress decodes as paged does
    frame = pd.DataFrame([{**point(on_tiny, r).columns(), **row} for r, row in (("paged", paged),
                                                                                ("compress_h2o", mine))])
    agree = compression.request_agreement(frame)
    others = agree[(agree["policy"] == "compress_h2o") & ~agree["compressed"]]
    assert len(agree) == 4 and (others["agreement"] == 1.0).all()


def test_compression_columns_of_a_run_that_never_compressed():
    assert serving.compression_columns([]) == {"compressions": 0, "requests_compressed": 0, "compressed_requests": [],
                                               "entries_kept_share": None}
    assert set(serving.compression_columns(None).values()) == {None}


# ---- the report, on synthetic rows -----------------------------------------------------------------------------------

def rows():
    """Two rates, each its own trace; paged preempts, compress_h2o compresses request 0 (at 2 requests/s also 2)."""
    base = {"num_requests": 3, "device_capacity_gb": 0.75, "slo_ttft_s": 2.0, "slo_tpot_s": 0.2, "completed": True,
            "oom": False, "outside": False, "repeat": 0, "slo_attainment": 1.0, "request_throughput": 1.0,
            "tpot_s_p99": 0.1, "max_running": 3, "device_kv_peak_bytes": 2**20}
    paged = {1.0: [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]], 2.0: [[1, 2, 3, 4], [5, 6, 7, 8], [7, 7, 7, 7]]}
    out = []
    for rate in (1.0, 2.0):
        sha = f"trace-{rate}"
        out.append({**base, "policy": "paged", "lossless": True, "request_rate": rate, "trace_sha": sha,
                    "output_token_ids": paged[rate], "preemptions": 4 * rate, "goodput": 1.0 / rate,
                    "ttft_s_p99": 1.5 * rate, "compressions": None, "requests_compressed": None,
                    "compressed_requests": None, "entries_kept_share": None})
        # request 0: 3 of 4 positions as paged's (one token replaced, the rest back in step); request 2 at 2
        # requests/s: 1 of 4; the uncompressed ones: paged's own
        mine = [[1, 2, 0, 4], [5, 6, 7, 8], [9, 9, 9, 9] if rate == 1.0 else [7, 0, 0, 0]]
        listed = [0] if rate == 1.0 else [0, 2]
        out.append({**base, "policy": "compress_h2o", "lossless": False, "request_rate": rate, "trace_sha": sha,
                    "output_token_ids": mine, "preemptions": 0, "goodput": 0.9, "ttft_s_p99": 1.2,
                    "compressions": len(listed) + 1, "requests_compressed": len(listed),
                    "compressed_requests": listed, "entries_kept_share": 0.5})
        # h2o evicts by its budget throughout: none of its requests is "compressed"; request 1 differs at its end
        out.append({**base, "policy": "h2o", "lossless": False, "request_rate": rate, "trace_sha": sha,
                    "output_token_ids": [[1, 2, 3, 4], [5, 6, 7, 0], paged[rate][2]], "preemptions": 0,
                    "goodput": 0.8, "ttft_s_p99": 1.1, "compressions": None, "requests_compressed": None,
                    "compressed_requests": None, "entries_kept_share": None})
    out.append({**base, "policy": "vllm (real)", "outside": True, "lossless": True, "request_rate": 1.0,
                "trace_sha": "trace-1.0", "output_token_ids": [[0, 0, 0, 0]] * 3, "preemptions": 1, "goodput": 1.0,
                "ttft_s_p99": 1.0})
    return pd.DataFrame(out)


def test_agreement_is_position_by_position_over_the_longer_output():
    assert compression.agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert compression.agreement([1, 9, 3, 4], [1, 2, 3, 4]) == 0.75  # not cut at the first difference
    assert compression.agreement([1, 2], [1, 2, 3, 4]) == 0.5  # a missing token is a different one
    assert compression.agreement([2, 3, 4, 5], [1, 2, 3, 4]) == 0.0  # shifted by one: no position agrees


@pytest.mark.parametrize("through_parquet", [False, True])
def test_the_compressed_requests_are_read_against_paged_on_the_same_trace(tmp_path, through_parquet):
    df = rows()
    if through_parquet:  # as the results store gives them back: arrays, not lists
        df.to_parquet(tmp_path / "rows.parquet", index=False)
        df = pd.read_parquet(tmp_path / "rows.parquet")
    agree = compression.request_agreement(df).set_index(["policy", "request_rate", "request"]).sort_index()
    assert "vllm (real)" not in agree.index.get_level_values("policy")  # another engine's kernels
    assert agree.loc[("compress_h2o", 1.0, 0), "agreement"] == 0.75 and agree.loc[("compress_h2o", 1.0, 0),
                                                                                  "compressed"]
    assert agree.loc[("compress_h2o", 2.0, 2), "agreement"] == 0.25  # against paged's tokens at 2, not at 1
    assert not agree.loc[("compress_h2o", 2.0, 1), "compressed"]
    assert "paged" not in agree.index.get_level_values("policy")  # the reference, not read against itself
    assert not agree.loc["h2o", "compressed"].any()
    table = compression.compression_table(df)
    compressed, others = "tokens as paged's: compressed requests", "tokens as paged's: the others"
    assert table.loc[("1", "compress_h2o"), compressed] == "0.75"
    assert table.loc[("2", "compress_h2o"), compressed] == "0.5"  # (0.75 + 0.25) / 2
    assert table.loc[("2", "compress_h2o"), others] == "1"
    assert table.loc[("1", "h2o"), compressed] == "" and table.loc[("1", "h2o"), others] == f"{(1 + 0.75 + 1) / 3:.3g}"
    assert table.loc[("1", "paged"), "preemptions"] == "4" and table.loc[("2", "compress_h2o"),
                                                                         "requests compressed"] == "2"
    assert table.loc[("1", "vllm (real)"), compressed] == "" and table.loc[("1", "vllm (real)"), others] == ""
    text = "\n".join(sentences.lines(df))
    assert ("compress_h2o at 2 requests/s: 2 of 3 requests compressed (3 compressions, each keeping 50% of a "
            "request's entries on average), 0 preemptions against 8 of paged's; goodput 0.9 against 0.5 requests/s, "
            "p99 TTFT 1.2 against 3 s; output tokens equal to paged's, position by position: 50.0% over the 2 "
            "compressed, 100.0% over the 1 not compressed (one replay: no interval).") in text
    assert not any(line.startswith("h2o at") for line in text.splitlines())  # it never compresses


def test_the_compression_sentences_say_how_many_replays_they_rest_on():
    df = pd.concat([rows(), rows().assign(repeat=1)], ignore_index=True)
    text = "\n".join(compression.compression_lines(df))
    assert "the medians of 2 replays" in text and "50.0% over the 4 compressed" in text


# ---- the command line ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["compress", "continuous"])
def test_kvlib_run_policy_compress_h2o_serves_under_the_schedule_it_is_given(tmp_path, schedule):
    """`kvlib run --policy compress_h2o` at a device capacity whose pool holds about 110 tokens, three requests of
    ~70: under `--schedule compress` at the policy's own compress_share (no --compress-share), every request served
    and none preempted; under `--schedule continuous`, preempted as paged is, nothing compressed."""
    import subprocess
    import sys

    from kvlib.models import load_model

    model = load_model("smollm2-135m")
    room = model.weights_bytes + model.packed_copy_bytes + 110 * model.spec.kv_bytes_per_token
    prompt = tmp_path / "p.txt"
    prompt.write_text(" ".join(["The cache keeps what attention reads, and the pool is small."] * 3))
    proc = subprocess.run([sys.executable, "-m", "kvlib", "run", "--policy", "compress_h2o", "--set", "block_size=4",
                           "--set", "compress_share=0.25", "--schedule", schedule, "--prefill", "chunked",
                           "--chunk-size", "16", "--batch-size", "3", "--max-new-tokens", "30", "--ignore-eos",
                           "--device-capacity-gb", f"{room / 0.9 / 2**30 + 1e-6:.9f}", "--prompt-file", str(prompt),
                           "--json"], capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert [len(o["token_ids"]) for o in out["outputs"]] == [30, 30, 30]
    assert out["policy"]["name"] == "compress_h2o" and out["policy"]["compress_share"] == 0.25
    if schedule == "compress":
        compressions = out["policy_stats"]["compressions"]
        assert compressions and out["metrics"]["preemptions"] == 0
        assert all(c["entries_after"] == round(0.25 * c["entries_before"]) for c in compressions)
    else:
        assert out["metrics"]["preemptions"] > 0 and "compressions" not in out["policy_stats"]


def test_kvlib_runs_compress_share_is_the_policys_setting_so_the_run_records_the_share_it_used():
    """`--compress-share` and compress_h2o's own `compress_share` are one value: the flag sets the setting (which
    `policy` in --json records), and a policy without the setting leaves it to the schedule (which policy_stats
    records as `compress_share`)."""
    from kvlib.cli import build_parser, settings_from_args

    def settings(*flags):
        return settings_from_args(build_parser().parse_args(["run", *flags]))

    assert settings("--policy", "compress_h2o", "--compress-share", "0.3")["compress_share"] == 0.3
    assert "compress_share" not in settings("--policy", "h2o", "--compress-share", "0.3")
    assert "compress_share" not in settings("--policy", "compress_h2o")


def test_the_compress_schedule_records_the_share_it_used(tiny):
    assert serve(tiny, "compress", 0.5, compress_share=0.25).stats["compress_share"] == 0.5
    assert serve(tiny, "compress", None, compress_share=0.25).stats["compress_share"] == 0.25
