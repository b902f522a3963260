"""FlexGen and FlexGen + H2O as the share on disk grows: decode tokens/s and bytes read from disk per generated token at
0, 50 and 100 % of the KV cache on disk (weights on the device), and with the decoder layers' weights on disk, beside
the disk's own sequential read bandwidth measured through the same reads (kvlib.memory.disk, out of the page cache).

Each run also records what the kernel says came off the storage (/proc/self/io) and so how much of the "disk" traffic
the page cache served. Writes benchmarks/results/offload.json.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time

import numpy as np
import torch
from smoke import SMOKE, results_path, sized

from kvlib.engine import Engine
from kvlib.memory.disk import OffloadFolder, Transfers
from kvlib.models import load_model
from kvlib.models.workloads import prompt_of_length
from kvlib.policies import make_policy
from kvlib.policies.flexgen import default_offload_dir

OUT = results_path("offload.json")
BATCH, PROMPT, NEW_TOKENS = sized(4, 2), sized(1024, 64), sized(16, 4)
PROBE_BYTES, PROBE_CHUNK = sized(512 * 2**20, 8 * 2**20), sized(8 * 2**20, 2**20)
# (label, W_DEV W_HOST, share of the KV on disk)
PLACEMENTS = [("kv 0% on disk", "100 0", 0), ("kv 50% on disk", "100 0", 50), ("kv 100% on disk", "100 0", 100),
              ("weights on disk, kv 0% on disk", "0 0", 0), ("weights and kv 100% on disk", "0 0", 100)]
RUNNERS = [("flexgen", {}, "fused"), ("flexgen_h2o", {"budget": 0.3}, "full")]


def disk_read_bandwidth(root: str) -> dict:
    """One file written, flushed and dropped from the page cache, then read sequentially in chunks (each chunk's
    pages dropped after it): bytes per second, and what the storage layer reports having served."""
    transfers = Transfers()
    folder = OffloadFolder(root, transfers)
    try:
        f = folder.file("probe.bin", PROBE_BYTES)
        chunk = np.random.default_rng(0).integers(0, 255, PROBE_CHUNK, dtype=np.uint8)
        for at in range(0, PROBE_BYTES, PROBE_CHUNK):
            f.write(at, chunk, count=False)
        start = time.perf_counter()
        for at in range(0, PROBE_BYTES, PROBE_CHUNK):
            f.read(at, PROBE_CHUNK)
        seconds = time.perf_counter() - start
    finally:
        folder.close()
    summary = transfers.summary()
    return {"bytes": PROBE_BYTES, "chunk_bytes": PROBE_CHUNK, "seconds": seconds,
            "read_bytes_per_s": PROBE_BYTES / seconds,
            "read_bytes_from_storage": summary["disk_read_bytes_from_storage"],
            "read_bytes_page_cache": summary["disk_read_bytes_page_cache"]}


def run_one(model, prompts, name, settings, mode, weights, kv_disk, root):
    percent = f"{weights} {100 - kv_disk} 0 100 0"
    policy = make_policy(name, percent=percent, offload_dir=root, **settings)
    after_prefill = {}
    original = policy.after_pass

    def record(step):
        original(step)
        if step.phase == "prefill":  # the bytes read until the last prompt is in
            after_prefill.update(policy.transfers.bytes)
    policy.after_pass = record
    result = Engine(model, policy).generate(prompts, NEW_TOKENS, prefill_mode=mode, stop_at_eos=False)
    stats, m = result.stats, result.metrics
    decode_tokens = m["decode_tokens"]
    read_in_decode = stats["disk_to_host_bytes"] - after_prefill.get("disk_to_host", 0)
    return {"runner": policy.label, "percent": percent, "kv_on_disk_percent": kv_disk,
            "weights_on_disk": weights == "0 0", "decode_tokens_per_s": m["decode_tokens_per_s"],
            "ttft_s": m["ttft_s"], "decode_tokens": decode_tokens,
            "disk_read_bytes_per_token": read_in_decode / decode_tokens if decode_tokens else None,
            "disk_read_bytes_per_s_in_decode": read_in_decode / m["decode_s"] if m.get("decode_s") else None,
            "memory_peak_bytes": {t: result.memory[t]["peak_bytes"] for t in ("device", "host", "disk")},
            **{k: v for k, v in stats.items() if k.endswith(("_bytes", "_s")) or k.startswith("disk_read")}}


def main() -> None:
    model = load_model("smollm2-135m", device="cpu")
    root = tempfile.mkdtemp(prefix="kvlib-bench-offload-") if SMOKE else default_offload_dir()
    bandwidth = disk_read_bandwidth(root)
    print("disk read", bandwidth)
    prompts = [prompt_of_length(model.tokenizer, PROMPT, offset=1000 * i) for i in range(BATCH)]
    rows = []
    for name, settings, mode in RUNNERS:
        for label, weights, kv_disk in PLACEMENTS:
            rows.append({"placement": label, **run_one(model, prompts, name, settings, mode, weights, kv_disk, root)})
            print({k: rows[-1][k] for k in ("runner", "placement", "decode_tokens_per_s", "disk_read_bytes_per_token",
                                            "disk_read_bytes_page_cache")})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"device": "cpu", "threads": torch.get_num_threads(), "model": model.name,
                               "batch": BATCH, "prompt_tokens": PROMPT, "new_tokens": NEW_TOKENS,
                               "offload_dir": root, "disk_read": bandwidth, "rows": rows}, indent=2))
    print(f"wrote {OUT}")
    if SMOKE:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
