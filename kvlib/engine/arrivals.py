"""When requests arrive, for serving under a request rate: an open loop, as `vllm bench serve` drives a server.

Gaps between arrivals are drawn from a gamma distribution of shape `burstiness` and mean 1 / rate: a Poisson process
at burstiness 1, burstier below it (more requests close together, longer lulls), steadier above. The times are what
the engine's loop reads (kvlib.engine.scheduler, kvlib.backends.vllm): a request joins when the clock passes its
arrival, so on a 2-core machine no second process generates load beside the engine.
"""

from __future__ import annotations

import math

import numpy as np

from kvlib.errors import UserError


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """n arrival times in seconds from the first request's (at 0); rate in requests per second, math.inf: all at 0."""
    if n < 1:
        raise UserError(f"the number of requests must be >= 1, got {n}")
    if not rate > 0:
        raise UserError(f"the request rate must be > 0 requests/s (inf: all at once), got {rate}")
    if not burstiness > 0:
        raise UserError(f"burstiness must be > 0 (1: a Poisson process), got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
