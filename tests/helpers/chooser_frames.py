"""The chooser's small frames with known answers (batch scaling, TTFT, accuracy), read by its tests and its command
line's."""

import pandas as pd

GIB = 2**30


def frames():
    # batch scaling: "fast" decodes fastest but runs out of memory at batch 8; "sparse" is second and lossy
    batch = []
    for policy, lossless, tps, peak in [("full", True, {1: 10, 4: 30, 8: 40}, {1: 1, 4: 2, 8: 3}),
                                        ("fast", True, {1: 20, 4: 60, 8: None}, {1: 1, 4: 3, 8: None}),
                                        ("sparse", False, {1: 15, 4: 50, 8: 70}, {1: 1, 4: 1.5, 8: 2})]:
        for b in (1, 4, 8):
            for repeat in range(2):
                batch.append({"policy": policy, "lossless": lossless, "batch_size": b, "oom": tps[b] is None,
                              "decode_tokens_per_s": tps[b], "device_peak_bytes": (peak[b] or 9) * GIB,
                              "min_prompt_tokens": 128, "max_prompt_tokens": 1024, "max_new_tokens": 32,
                              "budget": 0.3 if policy == "sparse" else None, "repeat": repeat,
                              "stat_decode_attention": "c"})
    ttft = [{"policy": p, "lossless": p != "sparse", "prompt_tokens": n, "prefill": mode, "oom": False,
             "ttft_s": base * n / 1000 * (1.5 if mode == "full" else 1.0), "device_peak_bytes": GIB}
            for p, base in [("full", 1.0), ("fast", 0.8), ("sparse", 0.5)] for n in (512, 2048)
            for mode in ("full", "fused")]
    # accuracy: sparse loses 8 pp at budget 0.1 and 2 pp at 0.5 (so 0.1 is the nearest scored budget below 0.3)
    accuracy = [{"task": "recall", "policy": p, "budget": b, "doc_id": i, "correct": float(i < n)}
                for p, b, n in [("full", None, 50), ("sparse", 0.1, 46), ("sparse", 0.5, 49)] for i in range(50)]
    return {"batch_scaling": pd.DataFrame(batch), "ttft": pd.DataFrame(ttft), "accuracy": pd.DataFrame(accuracy)}
