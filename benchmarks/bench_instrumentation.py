"""What kvlib's own instrumentation costs a decode step: its timer sections and its memory ledger, on and off.

kvlib's engine times itself by sections (kvlib.memory.timing) and books every buffer in a ledger
(kvlib.memory.ledger) while it runs; vLLM, in a timed run, reads nothing (kvlib.backends.vllm). For the two to be
timed alike, kvlib's instrumentation must cost a decode step next to nothing. Per policy, in one process: the rows
prefilled once, then decode trials of STEPS steps alternating with the instrumentation on and off (every section a
no-op context, every ledger call a no-op), each step timed around Session.decode by the caller. The figure is the
median step with it on over the median with it off.

    python benchmarks/bench_instrumentation.py

Writes benchmarks/results/instrumentation.json.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from contextlib import nullcontext

from smoke import SMOKE, results_path, sized

MODEL = "smollm2-135m"
POLICIES = sized(["full", "h2o", "quest", "kivi", "infinigen"], ["full", "h2o"])
BATCH, PROMPT_TOKENS = sized(8, 2), sized(512, 24)
TRIALS, STEPS = sized(8, 2), sized(16, 2)


def bare(engine) -> dict:
    """Replace the engine's timers and ledger calls by no-ops; returns what to put back."""
    saved = {"section": engine.timers.section, "transient": engine.ledger.transient, "add": engine.ledger.add,
             "set": engine.ledger.set}
    engine.timers.section = lambda name: nullcontext()
    engine.ledger.transient = lambda *args, **kwargs: nullcontext()
    engine.ledger.add = engine.ledger.set = lambda *args, **kwargs: None
    return saved


def restore(engine, saved: dict) -> None:
    engine.timers.section = saved["section"]
    engine.ledger.transient, engine.ledger.add, engine.ledger.set = saved["transient"], saved["add"], saved["set"]


def measure(policy: str) -> dict:
    import torch

    from kvlib.engine import Engine
    from kvlib.models import load_model
    from kvlib.models.workloads import mixed_length_prompts
    from kvlib.policies import make_policy

    model = load_model(MODEL, device="cpu")
    prompts = mixed_length_prompts(model.tokenizer, BATCH, PROMPT_TOKENS, PROMPT_TOKENS, seed=BATCH)
    chosen = make_policy(policy)
    engine = Engine(model, chosen)
    rows = list(range(BATCH))
    steps: dict[str, list[float]] = {"on": [], "off": []}
    with engine.session([len(p) for p in prompts], (2 * TRIALS + 1) * STEPS + 1) as session, torch.inference_mode():
        tokens = [int(session.prefill(r, p, chosen.preferred_prefill).argmax()) for r, p in enumerate(prompts)]
        for _ in range(STEPS):  # untimed: the first call of each shape, and the caches after the prefill
            tokens = session.decode(rows, tokens).argmax(-1).tolist()
        for trial in range(2 * TRIALS):
            mode = "on" if trial % 4 in (0, 3) else "off"  # on off off on: neither is always first
            saved = bare(engine) if mode == "off" else None
            for _ in range(STEPS):
                begin = time.perf_counter()
                tokens = session.decode(rows, tokens).argmax(-1).tolist()
                steps[mode].append(time.perf_counter() - begin)
            if saved is not None:
                restore(engine, saved)
    on, off = statistics.median(steps["on"]), statistics.median(steps["off"])
    return {"policy": policy, "step_s_on": on, "step_s_off": off, "cost": on / off - 1, "steps": steps}


def main() -> None:
    rows = [measure(p) for p in POLICIES]
    out = results_path("instrumentation.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "method": f"one process per run of this script; per policy {BATCH} rows of {PROMPT_TOKENS} tokens prefilled "
                  f"once, {STEPS} untimed steps, then {2 * TRIALS} trials of {STEPS} decode steps, instrumentation on "
                  "and off in the order on off off on, each "
                  "step timed around Session.decode; cost = median step on / median step off - 1",
        "load_average": os.getloadavg(), "smoke": SMOKE, "rows": rows}, indent=1) + "\n")
    for r in rows:
        print(f"{r['policy']}: {r['step_s_on'] * 1e3:.2f} ms on, {r['step_s_off'] * 1e3:.2f} ms off, "
              f"{100 * r['cost']:+.2f} %")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
