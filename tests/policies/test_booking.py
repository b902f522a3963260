"""The booking rule: the ledger books what a policy holds, no more and no less, for every registered policy.

A census walks the policy's attributes and adds up the storage of every tensor it finds (each storage once, views
included; modules a policy holds beside the model's, InfiniGen's query projections, by their parameters); after every
forward pass it must equal what the ledger books for the policy (KV, KV reserved, overhead) in each tier, within 1 %.
On SmolLM2 through kvlib's own forward (fused, prepacked) the model's weights are counted too: the ledger's weights and
weights_packed are its parameters, the packed copy of its tied head apart.
"""

import dataclasses

import pytest
import torch
from policy_examples import example

from kvlib.engine import Engine
from kvlib.policies import available, make_policy


def storage_of(tensor: torch.Tensor) -> tuple[int, int]:
    """(what identifies its storage, the storage's bytes); a prepacked oneDNN weight hides its storage: the tensor
    itself, its elements' bytes (as weights_bytes counts it)."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except NotImplementedError:
        return id(tensor), tensor.numel() * tensor.element_size()


def census(policy) -> dict[str, int]:
    """Bytes of every tensor the policy holds, by tier: by device on CUDA, by the policy's host_tensors on a CPU. The
    model's own parameters are the model's, not the policy's, wherever the policy holds them."""
    seen: set[int] = {storage_of(p)[0] for p in policy.model.model.parameters()}
    out = {"device": 0, "host": 0}

    def walk(obj, tier):
        if isinstance(obj, torch.Tensor):
            key, nbytes = storage_of(obj)
            if key in seen:
                return
            seen.add(key)
            if policy.device.type == "cuda":
                tier = "device" if obj.is_cuda else "host"
            out[tier] += nbytes
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item, tier)
        elif isinstance(obj, dict):
            for item in obj.values():
                walk(item, tier)
        elif isinstance(obj, torch.nn.Module):
            for parameter in obj.parameters():
                walk(parameter, tier)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name), tier)

    for name, value in vars(policy).items():
        walk(value, "host" if name in policy.host_tensors else "device")
    return out


def booked(ledger) -> dict[str, int]:
    return {tier: sum(ledger.current[(tier, c)] for c in ("kv", "kv_reserved", "overhead")) for tier in ("device", "host")}


def record_census(engine) -> list[tuple[dict, dict]]:
    """(census, ledger) after every forward pass and every fork of the engine's policy."""
    policy, records = engine.policy, []
    for hook in ("after_pass", "fork"):
        original = getattr(policy, hook)

        def wrapped(*args, _original=original):
            _original(*args)
            records.append((census(policy), booked(engine.ledger)))
        setattr(policy, hook, wrapped)
    return records


def check_census(model, name, settings=None):
    torch.manual_seed(1)
    prompts = [torch.randint(100, 5000, (n,)).tolist() for n in (70, 120, 40)]
    policy = make_policy(name, **(example(name, block_size=8) if settings is None else settings))
    engine = Engine(model, policy)
    records = record_census(engine)
    mode = "chunked" if "chunked" in policy.supported_prefill else policy.preferred_prefill
    engine.generate(prompts + [prompts[0]], 8, prefill_mode=mode, chunk_size=32, stop_at_eos=False,
                    share_prompts=True)
    assert len(records) > 8
    for held, ledger in records:
        for tier in ("device", "host"):
            assert ledger[tier] == pytest.approx(held[tier], rel=0.01), (tier, held, ledger)
    assert max(held["device"] for held, _ in records) > 0
    return engine


@pytest.mark.parametrize("name", available())
def test_the_ledger_books_what_the_policy_holds(tiny, name):
    check_census(tiny, name)


@pytest.mark.model
@pytest.mark.parametrize("name", available())
def test_on_kvlibs_own_forward_the_ledger_books_the_weights_their_packed_copy_and_the_policy(smollm, name):
    """SmolLM2 fused and prepacked, as the book runs it: every policy's tensors and modules, and the model's weights
    (each parameter once, its tied head's packed copy booked apart as weights_packed)."""
    assert smollm.kvlib_forward is not None and smollm.packed_copy_bytes > 0
    engine = check_census(smollm, name)
    parameters = sum(p.numel() * p.element_size() for p in smollm.model.parameters())
    components = engine.ledger.peak
    assert components[("device", "weights")] + components[("device", "weights_packed")] == parameters
    assert components[("device", "weights_packed")] == smollm.packed_copy_bytes


def test_infinigen_books_one_live_fetch_and_what_the_gather_moved(tiny):
    """Only one sparse layer's fetched entries are live at a time, and the bytes moved are what the gather copied
    (count.max() per row, padding included), not the tokens selected."""
    torch.manual_seed(2)
    prompts = [torch.randint(100, 5000, (n,)).tolist() for n in (90, 30)]
    policy = make_policy("infinigen", budget=0.3, fetch=True)
    engine = Engine(tiny, policy)
    live = []
    original = engine.ledger.add

    def add(tier, component, nbytes, where=""):
        original(tier, component, nbytes, where)
        if component == "kv" and ("infinigen fetch" in where or nbytes < 0):
            live.append(nbytes)
    engine.ledger.add = add
    result = engine.generate(prompts, 5, prefill_mode="fused", stop_at_eos=False)
    running, peak = 0, 0
    for nbytes in live:
        running += nbytes
        peak = max(peak, running)
    assert running == 0 and peak == max(live)  # each fetch dropped before the next one is made
    moved = sum(n for n in live if n > 0)
    assert result.stats["bytes_moved_host_to_device"] == moved


@pytest.mark.parametrize("name", available())
def test_a_capacity_below_the_weights_is_a_recorded_oom(tiny, name):
    policy = make_policy(name)
    result = Engine(tiny, policy, device_capacity_bytes=tiny.weights_bytes // 2).generate(
        [list(range(100, 140))], 4, prefill_mode=policy.preferred_prefill)
    assert result.oom is not None and result.oom["where"] == "model weights" and result.oom["phase"] == "setup"
    assert not result.metrics["completed"] and result.outputs[0]["token_ids"] == []
