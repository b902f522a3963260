"""FlexGen's zig-zag over a block of micro-batches (`gpu_batch_size`): each layer runs on each micro-batch in turn,
its weights brought to the device once for the block and the next micro-batch's cache loading while one computes; the
device stages two micro-batches' cache of a layer, not the batch's; the tokens are the ones of the batch run whole."""

import pytest
import torch
from prompts import prompts_of

from kvlib.engine import Engine
from kvlib.errors import UserError
from kvlib.memory import tiered_kv
from kvlib.models import offloaded_weights
from kvlib.policies import make_policy

PLACEMENTS = {"device": "100 0 100 0 100 0", "KV on the host": "100 0 0 100 100 0",
              "KV on three tiers, weights on disk": "0 0 30 30 100 0"}
LENGTHS = (40, 65, 23, 50, 31)  # 5 rows: micro-batches of 2 leave one of 1


def generate(model, policy, prompts, new, **kwargs):
    return Engine(model, policy).generate(prompts, new, prefill_mode="full", stop_at_eos=False, **kwargs)


def tokens(result):
    return [o["token_ids"] for o in result.outputs]


@pytest.mark.parametrize("where", sorted(PLACEMENTS))
@pytest.mark.parametrize("gpu_batch_size", [1, 2])
def test_micro_batches_generate_the_batchs_tokens(fused, tmp_path, where, gpu_batch_size):
    prompts = prompts_of(*LENGTHS)
    whole = generate(fused, make_policy("flexgen", percent=PLACEMENTS[where], offload_dir=str(tmp_path)), prompts, 8)
    cut = generate(fused, make_policy("flexgen", percent=PLACEMENTS[where], offload_dir=str(tmp_path),
                                      gpu_batch_size=gpu_batch_size), prompts, 8)
    assert tokens(cut) == tokens(whole)
    assert tokens(whole) == tokens(generate(fused, make_policy("full"), prompts, 8))


@pytest.mark.parametrize("where", ["device", "KV on three tiers, weights on disk"])
def test_micro_batches_keep_h2os_tokens_and_forks_across_them(fused, tmp_path, where):
    """FlexGen + H2O in micro-batches of 2: H2O's tokens; and answer choices forked off one prompt into rows of other
    micro-batches, finishing at different steps (decode passes over some rows of a micro-batch), score as H2O's."""
    prompts = prompts_of(*LENGTHS, seed=1)
    reference = generate(fused, make_policy("h2o", budget=0.2, budget_rule="flexgen"), prompts, 12)

    def placed():
        return make_policy("flexgen_h2o", budget=0.2, eviction="h2o", percent=PLACEMENTS[where],
                           offload_dir=str(tmp_path), gpu_batch_size=2)
    assert tokens(generate(fused, placed(), prompts, 12)) == tokens(reference)
    context, other = prompts_of(40, 30, seed=5)
    forked = [context, context, other, context]  # row 3 forks off row 0, in the other micro-batch
    forced = [t.tolist() for t in (torch.randint(100, 5000, (n,)) for n in (3, 5, 4, 2))]
    h2o = Engine(fused, make_policy("h2o", budget=0.5, budget_rule="flexgen")).generate(
        forked, 1, prefill_mode="full", forced=forced, share_prompts=True)
    cut = make_policy("flexgen_h2o", budget=0.5, eviction="h2o", percent=PLACEMENTS[where],
                      offload_dir=str(tmp_path), gpu_batch_size=2)
    result = Engine(fused, cut).generate(forked, 1, prefill_mode="full", forced=forced, share_prompts=True)
    for mine, theirs in zip(result.outputs, h2o.outputs):
        assert mine["logprobs"] == pytest.approx(theirs["logprobs"], abs=1e-4)


def test_each_layer_runs_every_micro_batch_with_its_weights_loaded_once(fused, tmp_path, monkeypatch):
    """The zig-zag: a decode pass visits (layer, micro-batch) units layer by layer, every micro-batch of a layer in
    turn, and reads each disk layer's weights once a pass, however many micro-batches share them."""
    units, weight_loads = [], []
    load_kv, load_weights = tiered_kv.TieredKV._load, offloaded_weights.WeightStreamer._load

    def kv(self, i, layer, group, n):
        units.append((layer, group))
        return load_kv(self, i, layer, group, n)

    def weights(self, i, count):
        if count:  # (not the weights put back after the run)
            weight_loads.append(i)
        return load_weights(self, i, count)
    monkeypatch.setattr(tiered_kv.TieredKV, "_load", kv)
    monkeypatch.setattr(offloaded_weights.WeightStreamer, "_load", weights)
    layers = fused.spec.num_layers
    new = 4
    results = {}
    for size in (None, 2):
        units.clear()
        weight_loads.clear()
        policy = make_policy("flexgen", percent="0 0 0 100 100 0", offload_dir=str(tmp_path), gpu_batch_size=size)
        results[size] = generate(fused, policy, prompts_of(*LENGTHS), new)
        decode_units = units[len(LENGTHS) * layers:]  # after the prompts' passes (one row each)
        groups = 1 if size is None else 3
        assert decode_units == [(layer, g) for _ in range(new - 1) for layer in range(layers) for g in range(groups)]
        assert weight_loads.count(0) == len(LENGTHS) + new - 1  # (layer 0's weights: once a pass)
    assert results[2].stats["disk_to_host_bytes"] == results[None].stats["disk_to_host_bytes"]


def test_the_device_stages_a_micro_batchs_cache_and_moves_the_same_kv(fused, tmp_path):
    """Staging shrinks with the micro-batch; each micro-batch loads its own rows' longest (here all rows are as
    long as each other's, so the KV bytes moved equal the whole batch's)."""
    prompts = prompts_of(*[48] * 6)
    runs = {size: generate(fused, make_policy("flexgen", percent="100 0 0 100 100 0", gpu_batch_size=size),
                           prompts, 6) for size in (6, 3, 1)}
    staged = {size: r.memory["device"]["peak_components"]["overhead"] for size, r in runs.items()}
    assert staged[6] == 2 * staged[3] == 6 * staged[1] > 0
    moved = {size: r.stats["host_to_device_bytes"] for size, r in runs.items()}
    assert moved[6] == moved[3] == moved[1] > 0
    assert runs[1].memory["device"]["peak_bytes"] < runs[6].memory["device"]["peak_bytes"]
    assert tokens(runs[1]) == tokens(runs[6])


def test_micro_batches_need_kvlibs_own_forward(tiny):
    assert tiny.kvlib_forward is None
    with pytest.raises(UserError, match="micro-batches only in kvlib's own forward"):
        generate(tiny, make_policy("flexgen", percent="100 0 0 100 100 0", gpu_batch_size=2), prompts_of(20, 30, 25),
                 2)
    one = generate(tiny, make_policy("flexgen", percent="100 0 0 100 100 0", gpu_batch_size=3), prompts_of(20, 30), 2)
    assert all(len(t) == 2 for t in tokens(one))  # a micro-batch as large as the batch: the batch whole


@pytest.mark.parametrize("bad", [0, -1, 1.5, "two"])
def test_a_bad_gpu_batch_size_is_one_clear_error(bad):
    with pytest.raises(UserError, match="gpu_batch_size"):
        make_policy("flexgen", gpu_batch_size=bad)


def test_gpu_batch_size_is_a_flag_of_run_and_eval():
    from kvlib.cli import build_parser, settings_from_args

    for command in ("run", "eval"):
        args = build_parser().parse_args([command, "--policy", "flexgen", "--gpu-batch-size", "4"])
        assert settings_from_args(args) == {"gpu_batch_size": 4}
    args = build_parser().parse_args(["run", "--policy", "h2o", "--gpu-batch-size", "4"])
    with pytest.raises(UserError, match="--gpu-batch-size"):
        settings_from_args(args)


def test_micro_batches_serve_requests_as_the_batch_whole(fused, tmp_path):
    """Under continuous batching with chunked prompts and outputs of different lengths, a decode pass covers some rows
    of some micro-batches: the requests get the tokens they get with the batch whole."""
    from kvlib.engine.scheduler import RunSettings, Sequence

    prompts = prompts_of(*LENGTHS, seed=3)
    served = {}
    for size in (None, 2):
        policy = make_policy("flexgen", percent="100 0 30 30 100 0", offload_dir=str(tmp_path), gpu_batch_size=size)
        served[size] = Engine(fused, policy).run([Sequence(p, n) for p, n in zip(prompts, (3, 12, 7, 1, 9))],
                                                 RunSettings("continuous", "chunked", chunk_size=16, stop_at_eos=False))
    assert tokens(served[2]) == tokens(served[None])
    assert [len(t) for t in tokens(served[2])] == [3, 12, 7, 1, 9]
