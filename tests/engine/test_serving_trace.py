"""Serving's admissions, preemptions and compressions on a fixed trace, with the clock out of it: requests arrive at
given decode steps into a pool too small for all of them, and what the scheduler did, step by step (which requests
were handed a token, which were preempted or compressed, each one's tokens), is what it was when it was recorded
(tests/data/serving_trace.json). A change to the scheduler's house (where admission is planned, who owns the block
accounting) must leave every event in place.

Record again after a change meant to change them (say which in the commit):
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 python tests/engine/test_serving_trace.py --record
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "policies"))  # as a script (--record) too, not only under pytest
from policy_examples import example, whole_prompt

from kvlib.engine import Engine
from kvlib.engine.scheduler import RunSettings, Scheduler, Sequence
from kvlib.policies import available, make_policy
from kvlib.policies.flexgen import ALL_ON_DEVICE

GOLDEN = Path(__file__).parents[1] / "data" / "serving_trace.json"
ARRIVAL_STEPS = (0, 0, 2, 5, 9, 14)
PROMPT_TOKENS = (40, 33, 27, 38, 21, 30)


def cases() -> list[tuple[str, str]]:
    """(policy, schedule): every policy that serves, continuous; those that compress, under compress too."""
    out = []
    for name in available():
        policy = make_policy(name, **example(name))
        if policy.can_release:
            out.append((name, "continuous"))
        if policy.can_compress:
            out.append((name, "compress"))
    return out


def trace(model, name: str, schedule: str) -> dict:
    """What the scheduler did, event by event, serving the fixed trace in a pool of about 120 tokens."""
    torch.manual_seed(0)
    prompts = [torch.randint(100, 5000, (n,)).tolist() for n in PROMPT_TOKENS]
    sequences = [Sequence(p, 24, arrival_step=s) for p, s in zip(prompts, ARRIVAL_STEPS)]
    weights = model.weights_bytes + model.packed_copy_bytes
    capacity = int((weights + 120 * model.spec.kv_bytes_per_token) / 0.9) + 1
    events = []
    handed = Scheduler.hand_over

    def hand_over(self, seqs, logits):
        events.append([self.step, sorted(s.index for s in seqs), self.preemptions, len(self.compressions)])
        handed(self, seqs, logits)

    Scheduler.hand_over = hand_over
    try:
        policy = make_policy(name, **example(name, "keeps_all",
                                             block_size=4, percent=ALL_ON_DEVICE))
        result = Engine(model, policy, device_capacity_bytes=capacity).run(sequences, RunSettings(schedule, "full" if whole_prompt(name) else "chunked", chunk_size=16, stop_at_eos=False))
    finally:
        Scheduler.hand_over = handed
    compressions = [{k: v for k, v in c.items() if k != "at_s"} for c in result.stats.get("compressions", [])]
    return {"tokens": [o["token_ids"] for o in result.outputs], "events": events,
            "preemptions": result.metrics["preemptions"], "compressions": compressions}


@pytest.mark.parametrize("name,schedule", cases())
def test_the_scheduler_does_on_a_fixed_trace_what_it_did_when_recorded(tiny, name, schedule):
    recorded = json.loads(GOLDEN.read_text())
    assert f"{name}/{schedule}" in recorded, "a policy added since the recording: record again (module docstring)"
    assert trace(tiny, name, schedule) == recorded[f"{name}/{schedule}"]


def test_the_trace_preempts_and_compresses_somewhere():
    """The recording exercises what it guards: a request preempted under continuous batching, one compressed."""
    recorded = json.loads(GOLDEN.read_text())
    assert any(t["preemptions"] for t in recorded.values())
    assert any(t["compressions"] for t in recorded.values())


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from conftest import tiny as tiny_fixture

    from kvlib.models import load_model

    model = tiny_fixture.__wrapped__(load_model("smollm2-135m", device="cpu"))
    GOLDEN.write_text(json.dumps({f"{n}/{s}": trace(model, n, s) for n, s in cases()}, indent=None) + "\n")
    print(f"recorded {len(cases())} traces in {GOLDEN}")
