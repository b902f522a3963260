"""What the serving tests of several folders share: a device capacity whose pool holds a given number of tokens, and
a small serving point's workload."""

VALUES = {"num_requests": 5, "min_prompt_tokens": 20, "max_prompt_tokens": 60, "min_output_tokens": 3,
          "max_output_tokens": 6, "burstiness": 1.0, "seed": 0, "chunk_size": 16, "prefill": "chunked",
          "slo_ttft_s": 30.0, "slo_tpot_s": 5.0, "request_rate": 50.0}


def capacity_for(tiny, kv_tokens: int) -> int:
    """A device capacity whose serving pool holds about kv_tokens tokens of `full`'s KV."""
    weights = tiny.weights_bytes + tiny.packed_copy_bytes
    return int((weights + kv_tokens * tiny.spec.kv_bytes_per_token) / 0.9) + 1
