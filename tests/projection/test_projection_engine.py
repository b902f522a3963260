"""The paper-scale projection counts a policy's decode step by hand at a published shape (no 8B model runs here):
that hand count must be the engine's own count (kvlib.memory.work) at a shape the engine can run, the tiny model's,
and its memory by tier the ledger's booking there."""

import pytest

from kvlib.engine.engine import Engine
from kvlib.policies.registry import make_policy
from kvlib.projection.paper_scale import Runner, Workload, memory_by_tier, partial_dims, step_work

PROMPT, NEW = 40, 9  # 8 decode steps after the prompt's first token


def counted(tiny, name, batch=1, **settings):
    policy = make_policy(name, **settings)
    engine = Engine(tiny, policy, calibration=list(range(100, 164)))
    prompts = [list(range(10 + 50 * r, 10 + 50 * r + PROMPT)) for r in range(batch)]
    result = engine.generate(prompts, NEW, prefill_mode=policy.preferred_prefill, stop_at_eos=False)
    return engine, result.row()


@pytest.mark.parametrize(("name", "settings", "batch"), [("full", {}, 1), ("full", {}, 3),
                                                         ("h2o", {"budget": 0.3, "budget_rule": "flexgen"}, 2)])
def test_the_hand_count_is_the_engines(tiny, name, settings, batch):
    _, row = counted(tiny, name, batch, **settings)
    steps = row["stat_work_decode_passes"]
    load = Workload("decode length", batch, PROMPT, steps)
    hand = step_work(tiny.pass_shape, tiny.spec.hidden_size, Runner(name, name), load).work
    for key in ("weight_bytes", "kv_read_bytes", "linear_flops", "attention_flops", "select_read_bytes"):
        assert hand[key] * steps == pytest.approx(row[f"stat_work_decode_{key}"], rel=1e-9), key
    booked = memory_by_tier(tiny.pass_shape, tiny.model.config, Runner(name, name), load)
    assert booked["device_kv_gb_projected"] * 1e9 == pytest.approx(row["device_kv_peak_bytes"], rel=1e-9)


def test_infinigen_at_its_measured_share_is_the_engines_count(tiny):
    """InfiniGen's hand count at the share the run fetched (batch 1, so no row pads another's picks): the same
    transfers, selection reads and attention as the engine counted."""
    engine, row = counted(tiny, "infinigen", budget=0.5)
    policy, s = engine.policy, tiny.spec
    steps = row["stat_work_decode_passes"]
    sparse = range(policy.dense, s.num_layers)
    fetched = sum(policy.usage.attended[layer] for layer in sparse) / len(sparse) - steps
    load = Workload("decode length", 1, PROMPT, steps)
    share = fetched / steps / (load.mean_held)
    hand = step_work(tiny.pass_shape, s.hidden_size, Runner("infinigen", "infinigen", share), load).work
    for key in ("host_to_device_bytes", "kv_read_bytes", "attention_flops", "weight_bytes"):
        assert hand[key] * steps == pytest.approx(row[f"stat_work_decode_{key}"], rel=1e-6), key
    assert hand["host_to_device_transfers"] * steps == row["stat_work_decode_host_to_device_transfers"]
    booked = memory_by_tier(tiny.pass_shape, tiny.model.config, Runner("infinigen", "infinigen", share), load)
    assert booked["host_gb_projected"] * 1e9 == pytest.approx(row["host_kv_peak_bytes"], rel=1e-9)
    # the ledger books the dense layers' entries as kv and the partial keys apart: the projection's device KV is both,
    # for the tokens held, at the fewest partial columns the official rule keeps (int(0.2 x D); the union of the
    # query's and the key's picks is wider where they differ: a projection of memory needed at least)
    partial = len(sparse) * s.num_kv_heads * s.dtype_bytes * (PROMPT + steps)
    assert booked["device_kv_gb_projected"] * 1e9 == pytest.approx(
        row["device_kv_peak_bytes"] + partial * partial_dims(tiny.pass_shape), rel=1e-9)
    assert partial_dims(tiny.pass_shape) <= policy.skew_cut.shape[-1]
