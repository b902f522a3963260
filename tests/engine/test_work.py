"""The work the engine counts per pass (kvlib.memory.work): exact for a known shape, the same for every policy that
reads what `full` reads, and InfiniGen's copies equal to what it fetched."""

import dataclasses

import pytest
import torch

from kvlib.engine.engine import Engine
from kvlib.models.pass_shape import PassShape
from kvlib.policies.registry import REGISTRY, make_policy

PROMPTS = [list(range(10, 26)), list(range(40, 73))]  # 16 and 33 tokens
NEW = 4


def run(model, name, **settings):
    policy = make_policy(name, **settings)
    engine = Engine(model, policy, calibration=list(range(100, 164)))
    return engine.generate(PROMPTS, NEW, prefill_mode=policy.preferred_prefill, stop_at_eos=False).stats


def test_pass_shape_counts_every_weight_once(tiny):
    shape = PassShape.of(tiny.model.config, 4)
    model = tiny.model
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert embed is not head  # untied: the table is not read whole, only its rows
    assert shape.weight_bytes == 4 * (sum(p.numel() for p in model.parameters()) - embed.numel())
    c = model.config
    per_layer = c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim \
        + c.num_attention_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    assert shape.linear_params == c.num_hidden_layers * per_layer
    assert shape.head_params == c.vocab_size * c.hidden_size


@pytest.mark.parametrize("model", ["tiny", "fused"])
def test_full_decode_step_reads_the_weights_and_every_cached_token(model, request):
    loaded = request.getfixturevalue(model)
    stats = run(loaded, "full")
    s, shape = loaded.spec, loaded.pass_shape
    steps = NEW - 1  # the first new token comes from the prefill
    held = [len(p) + t + 1 for t in range(steps) for p in PROMPTS]  # each row's tokens once the step's is in
    per_token = s.num_layers * s.num_kv_heads * 2 * s.head_dim * s.dtype_bytes
    assert stats["work_decode_passes"] == steps
    assert stats["work_decode_weight_bytes"] == steps * (shape.weight_bytes + len(PROMPTS) * shape.row_bytes)
    assert stats["work_decode_kv_read_bytes"] == sum(held) * per_token
    group = s.num_attention_heads // s.num_kv_heads
    assert stats["work_decode_attention_flops"] == 4 * s.head_dim * group * sum(held) * s.num_layers * s.num_kv_heads
    assert stats["work_decode_linear_flops"] == steps * len(PROMPTS) * 2 * (shape.linear_params + shape.head_params)
    assert stats["work_decode_host_to_device_transfers"] == 0
    # the prefill: every prompt once, dense and causal
    pairs = sum(n * (n + 1) // 2 for n in map(len, PROMPTS))
    assert stats["work_prefill_attention_flops"] == 4 * s.head_dim * s.num_layers * s.num_attention_heads * pairs


def at_full_budget(name):
    """A registered policy's settings under which it keeps and reads every token, or None where it has none."""
    fields = {f.name for f in dataclasses.fields(REGISTRY[name])}
    if REGISTRY[name].lossless:
        return {}
    if "budget" not in fields:
        return None
    settings = {"budget": 1.0}
    if "alpha" in fields:  # InfiniGen: every token within reach of the fetch, the cap at the whole row
        settings["alpha"] = float("inf")
    if "budget_rule" in fields:
        settings["budget_rule"] = "seen"
    return settings


@pytest.mark.parametrize("name", sorted(n for n in REGISTRY if not REGISTRY[n].outside))
def test_a_policy_at_budget_one_reads_what_full_reads(tiny, name):
    settings = at_full_budget(name)
    if settings is None:
        pytest.skip(f"{name} has no budget that keeps every token")
    full, other = run(tiny, "full"), run(tiny, name, **settings)
    for key in ("work_decode_passes", "work_decode_weight_bytes", "work_decode_kv_read_bytes",
                "work_decode_attention_flops", "work_decode_linear_flops", "work_prefill_attention_flops"):
        assert other[key] == full[key], key


def test_infinigen_copies_what_it_selected(tiny):
    """Batch 1 (no row pads another's picks): the bytes copied to the device are the tokens attended in the sparse
    layers, less each step's new token (computed on the device), times a token's bytes; a copy for keys and one for
    values per sparse layer and step."""
    engine = Engine(tiny, make_policy("infinigen", budget=0.5), calibration=list(range(100, 164)))
    stats = engine.generate(PROMPTS[1:], 8, stop_at_eos=False).stats
    policy, s = engine.policy, tiny.spec
    sparse = range(policy.dense, s.num_layers)
    steps = stats["work_decode_passes"]
    fetched = sum(policy.usage.attended[layer] for layer in sparse) - steps * len(sparse)
    assert fetched > 0
    assert stats["work_decode_host_to_device_bytes"] == fetched * s.num_kv_heads * 2 * s.head_dim * s.dtype_bytes
    assert stats["work_decode_host_to_device_transfers"] == 2 * steps * len(sparse)
    assert stats["work_decode_select_read_bytes"] > 0 and stats["work_decode_select_flops"] > 0


def test_a_uninstrumented_counter_counts_nothing():
    from kvlib.memory.work import Work

    work = Work(None)
    work.forward_pass("decode", 2, 1, torch.tensor([3, 4]))
    assert set(work.summary().values()) == {0}


def test_kivis_codes_are_read_as_codes(tiny):
    """Past its full-precision residual, KIVI's decode reads 2-bit codes and their scales: less than full's bytes for
    the same tokens attended (the same attention FLOPs), and more than the codes alone."""
    prompts = [list(range(10, 330))]
    full = Engine(tiny, make_policy("full")).generate(prompts, 3, stop_at_eos=False).stats
    kivi = Engine(tiny, make_policy("kivi", bits=2)).generate(prompts, 3, stop_at_eos=False).stats
    assert kivi["work_decode_attention_flops"] == full["work_decode_attention_flops"]
    assert full["work_decode_kv_read_bytes"] / 16 < kivi["work_decode_kv_read_bytes"] < full["work_decode_kv_read_bytes"] / 2
