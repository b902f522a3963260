"""Small results frames of the chapters with known answers, read by the tests of more than one page: batch scaling's
and accuracy's (the leads), items with known wrong answers and held bytes (the frontier), serving's rates."""

import math

import numpy as np
import pandas as pd


def batch_rows():
    rows = []
    for policy, tps, peak, lossless, budget in [("full", 100.0, 2.0, True, None), ("h2o", 130.0, 1.0, False, 0.3),
                                                ("paged", 101.0, 2.0, True, None)]:
        for batch in (1, 8):
            for r in range(8):
                rows.append({"policy": policy, "batch_size": batch, "repeat": r, "oom": False,
                             "decode_tokens_per_s": tps * batch * (1 + 0.01 * ((r * 7) % 5 - 2)),
                             "device_peak_bytes": peak * 2**30, "host_peak_bytes": 0, "lossless": lossless,
                             "budget": budget, "stat_decode_attention": "c"})
    rows.append({"policy": "kivi", "batch_size": 8, "repeat": 0, "oom": True, "decode_tokens_per_s": np.nan,
                 "device_peak_bytes": np.nan, "host_peak_bytes": np.nan, "lossless": False, "budget": None})
    return pd.DataFrame(rows)


def accuracy_rows():
    rows = [{"task": "recall", "policy": "full", "budget": None, "doc_id": i, "correct": 1.0} for i in range(60)]
    rows += [{"task": "recall", "policy": "h2o", "budget": b, "doc_id": i, "correct": float(i >= lost)}
             for b, lost in ((0.1, 30), (0.5, 0)) for i in range(60)]
    return pd.DataFrame(rows)


ITEMS = 100


def item_rows(policy, budget, wrong, held, task="kvlib_recall"):
    """One row per item: `wrong` the item ids it gets wrong."""
    return [{"model": "m", "task": task, "doc_id": i, "policy": policy, "budget": budget, "correct": float(i not in wrong),
             "ruler_score": math.nan, "length": 512, "kv_share_held": held} for i in range(ITEMS)]


def serving_frame(points: dict) -> pd.DataFrame:
    """points: {(policy, rate): share within SLO, or "oom"}."""
    rows = []
    for (policy, rate), share in points.items():
        oom = share == "oom"
        rows.append({"policy": policy, "request_rate": rate, "oom": oom, "completed": not oom,
                     "lossless": policy == "paged", "slo_attainment": None if oom else share,
                     "request_throughput": None if oom else rate * 0.9, "goodput": None if oom else rate * 0.9 * share,
                     "ttft_s_p50": None if oom else rate / 10, "ttft_s_p99": None if oom else rate / 5,
                     "ttft_s_p90": None if oom else rate / 6, "tpot_s_p90": None if oom else 0.08,
                     "budget": None if policy == "paged" else 0.3,
                     "tpot_s_p50": 0.05, "tpot_s_p99": 0.1, "output_throughput": rate * 20,
                     "max_running": {"paged": 4, "h2o": 12}.get(policy, 2) if rate >= 2 else 2,
                     "preemptions": 3 if policy == "paged" and rate >= 2 else 0,
                     "device_kv_peak_bytes": {"paged": 64, "h2o": 20}.get(policy, 30) * 2**20,
                     "num_requests": 16, "device_capacity_gb": 0.75, "slo_ttft_s": 2.0, "slo_tpot_s": 0.2})
    return pd.DataFrame(rows)


SYNTHETIC = serving_frame({("paged", 0.5): 1.0, ("paged", 1.0): 0.95, ("paged", 2.0): 0.5,
                   ("h2o", 0.5): 1.0, ("h2o", 1.0): 1.0, ("h2o", 2.0): 0.9,
                   ("quest", 0.5): 0.8, ("quest", 1.0): 1.0, ("quest", 2.0): 1.0,  # fails at the lowest: below it
                   ("snapkv", 0.5): 1.0, ("snapkv", 1.0): "oom", ("snapkv", 2.0): 1.0})
