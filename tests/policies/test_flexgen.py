"""FlexGen and FlexGen + H2O: placement moves bytes and changes no token; the bytes moved are what the placement
implies; 4-bit codes round-trip within their step; the disk tier's files go away however a run ends."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from prompts import prompts_of

from kvlib.engine import Engine
from kvlib.errors import UserError
from kvlib.memory import quant4
from kvlib.memory.placement import Placement, kv_split
from kvlib.policies import make_policy

# KV placements (device, host; the disk takes the rest), weights on the device; at 3 rows of 2 KV heads, whole rows
PLACEMENTS = {"device": (100, 0), "device+host": (50, 50), "three tiers": (34, 34), "host": (0, 100),
              "device+disk": (50, 0), "disk": (0, 0)}


def percent(kv_dev, kv_host):
    return f"100 0 {kv_dev} {kv_host} 100 0"


def tokens(result):
    return [o["token_ids"] for o in result.outputs]


def offload_folders(root: Path) -> list[Path]:
    return sorted(root.glob("kvlib-offload-*")) if root.exists() else []


# -- placement ------------------------------------------------------------------------------------------------------
def test_percent_is_read_as_flexgen_reads_it():
    p = Placement.parse("20 30 10 60 100 0")
    assert p.weights == pytest.approx((0.2, 0.3, 0.5)) and p.kv == pytest.approx((0.1, 0.6, 0.3))
    assert Placement.parse([100, 0, 100, 0, 100, 0]).all_on_device


@pytest.mark.parametrize("bad, match", [("100 0 100 0 100", "six numbers"), ("100 0 x 0 100 0", "six numbers"),
                                        ("100 0 120 0 100 0", r"\[0, 100\]"), ("60 50 100 0 100 0", "add up"),
                                        ("100 0 100 0 50 50", "ACT_DEV")])
def test_a_bad_percent_is_one_clear_error(bad, match):
    with pytest.raises(UserError, match=match):
        make_policy("flexgen", percent=bad)


def test_kv_segments_cover_every_row_and_head_once():
    for n in (1, 5, 6, 17):
        for kv in [(100, 0), (30, 30), (0, 0), (50, 50), (34, 33)]:
            cut = kv_split(n, 3, *kv)
            assert sum(cut) == 3 * n and min(cut) >= 0 and all(c % 3 == 0 for c in cut)  # whole rows


# -- 4-bit codes --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dim", [16, 64, 128])
def test_4bit_codes_round_trip_within_their_step(dim):
    torch.manual_seed(0)
    x = torch.randn(50, 3, dim) * torch.rand(50, 3, 1) * 4 + torch.randn(50, 3, 1)
    records = quant4.encode(x)
    assert records.dtype == torch.uint8 and records.shape[-1] == quant4.record_bytes(dim)
    back = quant4.decode(records, dim, torch.float32)
    g = quant4.group_size(dim)
    groups = x.reshape(50, 3, dim // g, g)
    step = ((groups.amax(-1) - groups.amin(-1)) / quant4.LEVELS)[..., None]
    error = (back.reshape(groups.shape) - groups).abs()
    assert bool((error <= step * 0.5 + 2e-3 * groups.abs().amax(-1, keepdim=True) + 1e-6).all())
    assert float(error.max()) > 0  # lossy: the test would notice a codec that stored raw values


def test_a_constant_group_decodes_to_its_value_without_nan():
    x = torch.full((4, 2, 64), 0.3)
    x[1] = 0.0
    x[2, 0, :32] = -7.5  # one group constant, the other not
    back = quant4.decode(quant4.encode(x), 64, torch.float32)
    assert torch.isfinite(back).all()
    assert torch.allclose(back, x, atol=1e-3)


# -- tokens ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", sorted(PLACEMENTS))
@pytest.mark.parametrize("mode", ["full", "chunked"])
def test_every_placement_generates_the_full_caches_tokens(tiny, tmp_path, where, mode):
    prompts = prompts_of(40, 65, 23)
    reference = Engine(tiny, make_policy("full")).generate(prompts, 12, prefill_mode=mode, chunk_size=16,
                                                           stop_at_eos=False)
    placed = Engine(tiny, make_policy("flexgen", percent=percent(*PLACEMENTS[where]), offload_dir=str(tmp_path)))
    result = placed.generate(prompts, 12, prefill_mode=mode, chunk_size=16, stop_at_eos=False)
    assert tokens(result) == tokens(reference)
    on_disk = PLACEMENTS[where] != (100, 0) and sum(PLACEMENTS[where]) < 100
    assert (result.memory["disk"]["peak_bytes"] > 0) == on_disk
    assert (result.stats["disk_to_host_bytes"] > 0) == on_disk
    assert offload_folders(tmp_path) == []


@pytest.mark.parametrize("where", sorted(PLACEMENTS))
@pytest.mark.parametrize("rule", ["flexgen", "seen"])
def test_every_placement_generates_h2os_tokens(tiny, tmp_path, where, rule):
    """FlexGen + H2O under kvlib's eviction (`eviction="h2o"`; the port's: tests/policies/test_fidelity_port.py) is
    H2O under either budget rule (the paper's, and the share of the tokens seen), wherever its cache lies; the
    budget is small enough that rows evict at every step."""
    prompts = prompts_of(40, 65, 23, seed=1)
    reference = Engine(tiny, make_policy("h2o", budget=0.2, budget_rule=rule)).generate(
        prompts, 16, prefill_mode="full", stop_at_eos=False)
    placed = make_policy("flexgen_h2o", budget=0.2, budget_rule=rule, eviction="h2o",
                         percent=percent(*PLACEMENTS[where]), offload_dir=str(tmp_path))
    result = Engine(tiny, placed).generate(prompts, 16, prefill_mode="full", stop_at_eos=False)
    assert tokens(result) == tokens(reference)
    assert result.stats["kv_share_attended"] < 0.6
    assert offload_folders(tmp_path) == []


def test_flexgen_h2o_at_full_budget_is_the_full_cache(tiny, tmp_path):
    prompts = prompts_of(30, 50, seed=2)
    full = Engine(tiny, make_policy("full")).generate(prompts, 10, prefill_mode="full", stop_at_eos=False)
    placed = make_policy("flexgen_h2o", budget=1.0, percent=percent(0, 50), offload_dir=str(tmp_path))
    assert tokens(Engine(tiny, placed).generate(prompts, 10, prefill_mode="full", stop_at_eos=False)) == tokens(full)


def test_compressed_cache_holds_4bit_records_on_every_tier_and_stays_close(tiny, tmp_path):
    prompts = prompts_of(40, 65, 23)
    full = Engine(tiny, make_policy("full")).generate(prompts, 8, prefill_mode="full", stop_at_eos=False)
    for kv in [(100, 0), (0, 0)]:
        policy = make_policy("flexgen", percent=percent(*kv), compress_cache=True, offload_dir=str(tmp_path))
        result = Engine(tiny, policy).generate(prompts, 8, prefill_mode="full", stop_at_eos=False)
        assert result.stats["kv_bits"] == 6  # 4-bit codes and a 16-wide group's fp16 scale and minimum
        s = tiny.spec
        held = s.num_layers * 2 * policy.capacity * 3 * s.num_kv_heads * quant4.record_bytes(s.head_dim)
        tier = "device" if kv == (100, 0) else "disk"
        mem = result.memory[tier]["components"]
        assert mem["kv"] + mem["kv_reserved"] == held  # 12 bytes a token of a 16-wide head, not 64
        agree = sum(a == b for x, y in zip(tokens(result), tokens(full)) for a, b in zip(x, y))
        assert agree >= 0.5 * 3 * 8  # lossy but close (a random 4-layer model); placement is tested uncompressed


# -- bytes moved ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv", [(50, 0), (0, 50), (0, 0), (30, 30)])
def test_the_bytes_moved_are_what_the_placement_implies(tiny, tmp_path, kv):
    """Decode step i loads every (row, head) off the device for the longest row's tokens so far; a pass stores what
    it wrote (a prompt, then a token a row) back to each (row, head)'s tier."""
    lengths, new = (30, 50, 20), 7
    s = tiny.spec
    policy = make_policy("flexgen", percent=percent(*kv), offload_dir=str(tmp_path))
    result = Engine(tiny, policy).generate(prompts_of(*lengths), new, prefill_mode="full", stop_at_eos=False)
    dev, host, disk = kv_split(len(lengths), s.num_kv_heads, *kv)
    record = s.head_dim * s.dtype_bytes * 2 * s.num_layers  # keys and values of one token of one head, every layer
    read_tokens = sum(max(lengths) + i for i in range(new - 1))  # the first token comes from the prefill
    written = [n + new - 1 for n in lengths]  # each row's tokens, per head
    flats_written = [w for w in written for _ in range(s.num_kv_heads)]  # rows x heads, row-major
    host_w = sum(flats_written[dev:dev + host]) * record
    disk_w = sum(flats_written[dev + host:]) * record
    stats = result.stats
    assert stats["disk_to_host_bytes"] == read_tokens * disk * record
    assert stats["disk_to_host_bytes_in_decode"] == stats["disk_to_host_bytes"]  # a prompt's pass reads nothing back
    assert stats["host_to_device_bytes"] == read_tokens * (host + disk) * record
    assert stats["device_to_host_bytes"] == host_w + disk_w
    assert stats["host_to_disk_bytes"] == disk_w
    assert stats["disk_read_bytes_page_cache"] in (0, None) or stats["disk_read_bytes_page_cache"] < \
        stats["disk_to_host_bytes"]


def test_reads_of_the_process_are_not_the_tiers_when_the_tier_read_nothing(tiny, tmp_path, monkeypatch):
    """/proc/self/io counts the whole process: a library paged in mid-run must not read as the disk tier's bytes."""
    from kvlib.memory import disk
    counter = iter(range(0, 10**9, 12288))
    monkeypatch.setattr(disk, "storage_read_bytes", lambda: next(counter))
    on_device = make_policy("flexgen", percent=percent(100, 0), offload_dir=str(tmp_path))
    stats = Engine(tiny, on_device).generate(prompts_of(20), 3, prefill_mode="full").stats
    assert stats["disk_to_host_bytes"] == 0 and stats["disk_read_bytes_from_storage"] == 0
    on_disk = make_policy("flexgen", percent=percent(0, 0), offload_dir=str(tmp_path))
    stats = Engine(tiny, on_disk).generate(prompts_of(20), 3, prefill_mode="full").stats
    assert stats["disk_to_host_bytes"] > 0 and stats["disk_read_bytes_from_storage"] > 0


# -- the offload folder ---------------------------------------------------------------------------------------------
def test_the_offload_files_are_removed_after_an_exception(tiny, tmp_path):
    policy = make_policy("flexgen", percent=percent(0, 0), offload_dir=str(tmp_path))
    engine = Engine(tiny, policy)
    original, calls = policy.attend, []

    def failing(layer, *args):
        calls.append(layer)
        if len(calls) == 3 * tiny.spec.num_layers:  # a while into the run, its files on disk
            assert [f.name for f in offload_folders(tmp_path)[0].iterdir()] != []
            raise RuntimeError("boom")
        return original(layer, *args)
    policy.attend = failing
    with pytest.raises(RuntimeError, match="boom"):
        engine.generate(prompts_of(20, 30), 8, prefill_mode="full", stop_at_eos=False)
    assert offload_folders(tmp_path) == []


SIGINT_CHILD = textwrap.dedent("""
    import faulthandler, signal, sys, torch
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for every thread's stack if it hangs
    # Ctrl-C as a terminal delivers it: a suite started in the background of a non-interactive shell inherits SIGINT
    # ignored (POSIX), and Python then leaves it ignored, so the child would never see the signal (the one hang seen)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from transformers import LlamaConfig, LlamaForCausalLM
    from kvlib.kernels.attention import register_attention
    from kvlib.models import LoadedModel, ModelSpec
    from kvlib.engine import Engine
    from kvlib.policies import make_policy

    class Tokens:
        eos_token_id = 0
        def decode(self, ids, **kwargs):
            return ""

    register_attention()
    config = LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
    config._attn_implementation = "kvlib"
    model = LoadedModel("tiny", LlamaForCausalLM(config).eval(), Tokens(),
                        ModelSpec.from_config("tiny", config, torch.float32), torch.device("cpu"))
    engine = Engine(model, make_policy("flexgen", percent="100 0 0 0 100 0", offload_dir=sys.argv[1]))
    while True:
        engine.generate([list(range(10, 200))], 2000, prefill_mode="full", stop_at_eos=False)
""")


def test_the_offload_files_are_removed_after_sigint(tmp_path):
    root = tmp_path / "offload"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    child = subprocess.Popen([sys.executable, "-c", SIGINT_CHILD, str(root)], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not any(f.iterdir() for f in offload_folders(root)):  # a run under way, its files written
            assert child.poll() is None, child.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the child never wrote its offload files"
            time.sleep(0.2)
        time.sleep(0.5)
        child.send_signal(signal.SIGINT)
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGUSR1)
            time.sleep(2)
            child.kill()
            pytest.fail("the child did not exit within 60 s of SIGINT; its threads:\n"
                        + child.stderr.read().decode()[-6000:])
    finally:
        if child.poll() is None:
            child.kill()
    assert b"KeyboardInterrupt" in child.stderr.read()
    assert offload_folders(root) == []


def test_an_unwritable_offload_folder_is_one_clear_error(tiny, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    folders = [blocked, blocked / "below"]
    if os.geteuid() != 0:  # (root writes anywhere: a read-only mode stops only others)
        readonly = tmp_path / "readonly"
        readonly.mkdir(mode=0o500)
        folders.append(readonly)
    for folder in folders:
        policy = make_policy("flexgen", percent=percent(0, 0), offload_dir=str(folder))
        with pytest.raises(UserError, match="offload folder .* is not writable"):
            Engine(tiny, policy).generate(prompts_of(20), 2, prefill_mode="full")


def test_placement_flags_are_refused_for_other_policies():
    from kvlib.cli import build_parser, settings_from_args

    args = build_parser().parse_args(["run", "--policy", "h2o", "--percent", "100", "0", "50", "50", "100", "0"])
    with pytest.raises(UserError, match="flexgen and flexgen_h2o"):
        settings_from_args(args)
    args = build_parser().parse_args(["run", "--policy", "flexgen_h2o", "--percent", "100", "0", "50", "0", "100",
                                      "0", "--compress-cache", "--offload-dir", "/tmp/x", "--budget", "0.2"])
    settings = settings_from_args(args)
    assert settings == {"budget": 0.2, "percent": "100 0 50 0 100 0", "compress_cache": True, "offload_dir": "/tmp/x"}
    assert make_policy("flexgen_h2o", **settings).placement.kv == pytest.approx((0.5, 0, 0.5))


# -- weights off the device -----------------------------------------------------------------------------------------
WEIGHT_PLACEMENTS = {"host": "50 50 100 0 100 0", "disk": "0 0 100 0 100 0",
                     "three tiers, KV split too": "25 25 40 30 100 0",
                     "all off the device": "0 50 0 50 100 0"}


@pytest.mark.parametrize("where", sorted(WEIGHT_PLACEMENTS))
def test_weights_off_the_device_generate_the_full_caches_tokens(fused, tmp_path, where):
    prompts = prompts_of(40, 65, 23)
    probe = torch.tensor([prompts[0]])
    with torch.no_grad():
        before = fused.model(probe).logits
    weights = fused.weights_bytes
    reference = Engine(fused, make_policy("full")).generate(prompts, 8, prefill_mode="full", stop_at_eos=False)
    policy = make_policy("flexgen", percent=WEIGHT_PLACEMENTS[where], offload_dir=str(tmp_path))
    result = Engine(fused, policy).generate(prompts, 8, prefill_mode="full", stop_at_eos=False)
    assert tokens(result) == tokens(reference)
    from kvlib.models.offloaded_weights import decoder_layers, placed_parts

    w_dev, w_host = Placement.parse(WEIGHT_PLACEMENTS[where]).percents[0:2]
    parts = [p for layer in decoder_layers(fused.model) for p in placed_parts(layer, w_dev, w_host)]
    off = {t: sum(part.nbytes() for part, tier in parts if tier == t) for t in ("host", "disk")}
    assert result.memory["disk"]["peak_components"]["weights"] == off["disk"]
    assert result.memory["host"]["peak_components"]["weights"] == off["host"]
    passes = len(prompts) + 8 - 1  # a prefill a prompt, then a decode step a token after the first
    kv_read = result.stats["disk_to_host_bytes"] - passes * off["disk"]  # each pass reads every disk layer once
    assert kv_read >= 0 and (kv_read > 0) == (Placement.parse(WEIGHT_PLACEMENTS[where]).kv[2] > 0)
    # the decode steps' reads apart: every disk layer once a step, and all of the cache's (a prompt's pass reads none)
    assert result.stats["disk_to_host_bytes_in_decode"] == (8 - 1) * off["disk"] + kv_read
    assert fused.weights_bytes == weights  # every weight back in the model after the run
    with torch.no_grad():
        assert torch.equal(fused.model(probe).logits, before)
    assert offload_folders(tmp_path) == []


def test_a_capacity_full_runs_out_of_is_enough_with_weights_and_kv_on_disk(fused, tmp_path):
    """The device capacity just below what `full` needs at its peak: `full` is a recorded OOM, FlexGen + H2O with its
    layers' weights and its cache on disk completes within it."""
    prompts = prompts_of(200, 200)

    def flexgen_h2o():
        return make_policy("flexgen_h2o", budget=0.2, percent="0 0 0 0 100 0", offload_dir=str(tmp_path))

    full_peak = Engine(fused, make_policy("full")).generate(prompts, 4, prefill_mode="full").memory["device"]["peak_bytes"]
    capacity = full_peak - 1
    full = Engine(fused, make_policy("full"), device_capacity_bytes=capacity).generate(prompts, 4, prefill_mode="full")
    assert full.oom is not None
    placed = Engine(fused, flexgen_h2o(), device_capacity_bytes=capacity).generate(prompts, 4, prefill_mode="full")
    assert placed.oom is None and all(len(o["token_ids"]) == 4 for o in placed.outputs)
    assert placed.memory["device"]["peak_bytes"] <= capacity and placed.memory["device"]["kv_bytes"] == 0
    disk = placed.memory["disk"]["peak_components"]
    assert disk["weights"] > 0 and disk["kv"] > 0


def test_a_full_offload_folder_is_one_clear_error(tiny, tmp_path, monkeypatch):
    import errno

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", no_space)
    policy = make_policy("flexgen", percent=percent(0, 0), offload_dir=str(tmp_path))
    with pytest.raises(UserError, match="offload folder .* is full"):
        Engine(tiny, policy).generate(prompts_of(20), 2, prefill_mode="full")
    assert offload_folders(tmp_path) == []


def test_placement_is_a_setting_of_a_profile_and_of_eval():
    from kvlib.cli import build_parser, settings_from_args

    assert make_policy("flexgen", percent=[100, 0, 50, 50, 100, 0]).percent == "100 0 50 50 100 0"  # a params list
    args = build_parser().parse_args(["eval", "--policy", "flexgen", "--percent", "100", "0", "0", "0", "100", "0",
                                      "--compress-cache"])
    assert settings_from_args(args) == {"percent": "100 0 0 0 100 0", "compress_cache": True}


def test_weights_off_the_device_need_kvlibs_own_forward(tiny, tmp_path):
    assert tiny.kvlib_forward is None  # transformers' forward: no hook around a layer
    policy = make_policy("flexgen", percent="50 50 100 0 100 0", offload_dir=str(tmp_path))
    with pytest.raises(UserError, match="kvlib's own forward"):
        Engine(tiny, policy).generate(prompts_of(20), 2, prefill_mode="full")
