"""The findings state a difference only when it exceeds what was measured to vary."""

import pandas as pd
import pytest

from kvlib.report import findings, tables


def ttft_rows(policy, values, prompt_tokens=512):
    return [{"policy": policy, "prefill": "fused", "prompt_tokens": prompt_tokens, "ttft_s": v, "oom": False}
            for v in values]


def test_ttft_verdict_only_when_the_repeats_do_not_overlap():
    apart = pd.DataFrame(ttft_rows("full", [1.0, 1.1, 1.05]) + ttft_rows("paged", [0.5, 0.52, 0.55]))
    assert any("paged/fused is faster than full/fused on TTFT" in line for line in findings.ttft(apart))
    close = pd.DataFrame(ttft_rows("full", [1.0, 1.3, 1.05]) + ttft_rows("paged", [0.9, 1.1, 0.95]))
    assert any("within noise" in line for line in findings.ttft(close))
    assert not any("is faster than" in line for line in findings.ttft(close))


def test_decode_throughput_spread_comes_from_the_steps():
    rows = [{"policy": p, "batch_size": 8, "oom": False, "decode_tokens_per_s": tps, "decode_tokens_per_s_q1": q1,
             "decode_tokens_per_s_q3": q3, "decode_steps": 31, "device_peak_bytes": 2**30, "host_peak_bytes": 0,
             "stat_decode_attention": "c"}
            for p, tps, q1, q3 in [("full", 50.0, 45.0, 55.0), ("paged", 53.0, 48.0, 58.0), ("h2o", 80.0, 75.0, 85.0)]]
    lines = findings.batch_scaling(pd.DataFrame(rows))
    assert any("h2o is faster than paged on decode throughput" in line for line in lines)
    assert any(line.startswith("Ours: paged vs full") and "within noise" in line for line in lines)


def test_throughputs_from_different_decode_kernels_are_not_compared():
    rows = [{"policy": p, "batch_size": 8, "oom": False, "decode_tokens_per_s": tps, "decode_steps": 31,
             "device_peak_bytes": 2**30, "host_peak_bytes": 0, "stat_decode_attention": kernel}
            for p, tps, kernel in [("full", 50.0, "c"), ("paged", 53.0, "c"), ("h2o", 20.0, "torch")]
            for _ in range(2)]
    lines = findings.batch_scaling(pd.DataFrame(rows))
    assert any("did not all decode with the same attention kernel (c: full, paged; torch: h2o)" in line
               for line in lines)
    assert any(line.startswith("Ours: h2o vs full") and "not compared" in line for line in lines)
    assert not any(line.startswith("Ours: h2o vs full") and "throughput per GiB" in line for line in lines)
    assert any(line.startswith("Ours: paged vs full") and "throughput per GiB" in line for line in lines)


@pytest.mark.parametrize("correct, n, low, high", [(12, 12, 0.757, 1.0), (6, 12, 0.254, 0.746), (0, 36, 0.0, 0.096)])
def test_wilson_interval(correct, n, low, high):
    assert tables.wilson(correct, n) == pytest.approx((low, high), abs=1e-3)


def test_one_recall_item_is_within_noise():
    """12 items: H2O one item behind InfiniGen is no finding; six items behind is."""
    def rows(policy, correct, budget=0.1):
        return [{"task": "kvlib_recall", "policy": policy, "budget": budget, "correct": float(i < correct)}
                for i in range(12)]
    near = pd.DataFrame(rows("full", 12, None) + rows("h2o", 8) + rows("infinigen", 9))
    assert any("within noise" in line for line in findings.accuracy(near))
    far = pd.DataFrame(rows("full", 12, None) + rows("h2o", 2) + rows("infinigen", 11))
    assert any("H2O loses more than InfiniGen (95 % intervals do not overlap" in line for line in findings.accuracy(far))
