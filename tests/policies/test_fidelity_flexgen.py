"""FlexGen as FMInference/FlexLLMGen@004ffef has it, each rule re-stated here from the official code (not by calling
kvlib) and checked against what kvlib places, books and reports: init_weight_list's placement of a layer's tensors
(flex_opt.py), TorchMixedDevice's split of the KV by whole rows (pytorch_backend.py), the bits a 4-bit record costs
(compression.py's groups of 64 with an fp16 scale and minimum); and kvlib's own duties around it: an error in start
is never masked by finish, dead runs' offload folders are swept, copies on CUDA from pinned memory on a side stream,
weight waits and 4-bit coding timed apart."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from prompts import prompts_of

from kvlib.engine import Engine
from kvlib.policies import make_policy

TIERS = ("device", "host", "disk")


class Tokens:
    eos_token_id = 0

    def decode(self, ids, **kwargs):
        return ""


def llama(head_dim: int):
    """A 2-layer random Llama of this head width (transformers' forward)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvlib.kernels.attention import register_attention
    from kvlib.models import LoadedModel, ModelSpec

    register_attention()
    config = LlamaConfig(vocab_size=500, hidden_size=2 * head_dim, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim, max_position_embeddings=256)
    config._attn_implementation = "kvlib"
    return LoadedModel("llama", LlamaForCausalLM(config).eval(), Tokens(),
                       ModelSpec.from_config("llama", config, torch.float32), torch.device("cpu"))


# -- init_weight_list (flex_opt.py) ---------------------------------------------------------------------------------
def official_init_weight_list(sizes, w_gpu_percent, w_cpu_percent):
    """flex_opt.py init_weight_list with get_choice: the tiers' percents in the order disk, cpu, gpu, cumulated; each
    tensor's midpoint percent of the layer's elements; the first cumulated percent above it picks the tier."""
    dev_percents = np.cumsum([100 - w_gpu_percent - w_cpu_percent, w_cpu_percent, w_gpu_percent])
    cumsum = np.cumsum(sizes)
    tiers = []
    for i, size in enumerate(sizes):
        mid_percent = (cumsum[i] - size / 2) / cumsum[-1]
        choice = [t for t, p in zip(("disk", "host", "device"), dev_percents) if mid_percent * 100 < p]
        tiers.append(choice[0] if choice else "device")
    return tiers


def flexgen_layers_of(config):
    """A Llama decoder layer as FlexGen's SelfAttention and MLP weight_specs lay out an OPT one, in their order: the
    projections (Q, K, V, out; fc1 = gate and up, fc2 = down), then the layer norm. Element counts."""
    h, d = config.hidden_size, config.head_dim
    q, kv, inter = config.num_attention_heads * d, config.num_key_value_heads * d, config.intermediate_size
    return [[q * h, kv * h, kv * h, h * q, h], [inter * h, inter * h, h * inter, h]]


def official_weight_bytes(config, w_gpu, w_cpu):
    """Bytes (fp32) of every decoder layer's tensors on each tier, FlexGen's rule within each of its layers."""
    out = dict.fromkeys(TIERS, 0)
    for sizes in flexgen_layers_of(config):
        for size, tier in zip(sizes, official_init_weight_list(sizes, w_gpu, w_cpu)):
            out[tier] += 4 * size * config.num_hidden_layers
    return out


@pytest.mark.parametrize("w", [(30, 40), (50, 50), (0, 60), (80, 0)])
def test_weights_are_split_within_each_layer_as_init_weight_list_splits_them(fused, tmp_path, w):
    """Every layer split the same way, tensor by tensor: the ledger's host and disk weights are the re-stated rule's
    (kvlib 16d4b36 placed whole decoder layers by their midpoints across the model)."""
    expected = official_weight_bytes(fused.model.config, *w)
    assert sum(1 for n in expected.values() if n) >= 2  # each layer really split
    policy = make_policy("flexgen", percent=f"{w[0]} {w[1]} 100 0 100 0", offload_dir=str(tmp_path))
    result = Engine(fused, policy).generate(prompts_of(12, 20), 3, prefill_mode="full", stop_at_eos=False)
    for tier in ("host", "disk"):
        assert result.memory[tier]["peak_components"].get("weights", 0) == expected[tier]
    reference = Engine(fused, make_policy("full")).generate(prompts_of(12, 20), 3, prefill_mode="full",
                                                            stop_at_eos=False)
    assert [o["token_ids"] for o in result.outputs] == [o["token_ids"] for o in reference.outputs]


def test_each_tensor_of_a_layer_goes_to_the_tier_init_weight_list_picks(fused):
    from kvlib.models.offloaded_weights import decoder_layers, flexgen_layers, placed_parts

    layer = decoder_layers(fused.model)[0]
    sizes = flexgen_layers_of(fused.model.config)
    assert [[p.numel() for p in parts] for parts in flexgen_layers(layer)] == sizes
    for w in [(30, 40), (50, 50), (0, 60), (20, 0), (100, 0), (0, 0)]:
        expected = [t for s in sizes for t in official_init_weight_list(s, *w)]
        assert [tier for _, tier in placed_parts(layer, *w)] == expected


# -- TorchMixedDevice.init_cache_one_gpu_batch (pytorch_backend.py) -------------------------------------------------
def official_kv_split(batch, num_head, cache_gpu_percent, cache_cpu_percent):
    """pytorch_backend.py ~744-752: the (batch x heads) axis cut into gpu, cpu, disk lengths, each rounded down to a
    multiple of num_head; with no disk share the cpu takes the rest, else the disk does."""
    n = batch * num_head
    len_gpu = int(n * cache_gpu_percent / 100) // num_head * num_head
    if 100 - cache_gpu_percent - cache_cpu_percent == 0:
        return {"device": len_gpu, "host": n - len_gpu, "disk": 0}
    len_cpu = int(n * cache_cpu_percent / 100) // num_head * num_head
    return {"device": len_gpu, "host": len_cpu, "disk": n - len_gpu - len_cpu}


@pytest.mark.parametrize("batch, kv", [(1, (0, 50)), (1, (50, 50)), (3, (50, 30)), (3, (25, 75)), (16, (30, 30)),
                                       (16, (10, 0))])
def test_the_kv_is_split_by_whole_rows_as_torchmixeddevice_splits_it(tiny, tmp_path, batch, kv):
    """At batch 1, `KV_DEV 0 KV_HOST 50` puts the whole row on disk (kvlib 16d4b36 cut per (row, head), rounded to
    the nearest, and put half of it on the host)."""
    s = tiny.spec
    heads = official_kv_split(batch, s.num_kv_heads, *kv)
    new, length = 2, 8
    record = 2 * s.num_layers * s.head_dim * s.dtype_bytes * (length + new)  # keys and values of a (row, head)
    policy = make_policy("flexgen", percent=f"100 0 {kv[0]} {kv[1]} 100 0", offload_dir=str(tmp_path))
    result = Engine(tiny, policy).generate(prompts_of(*[length] * batch), new, prefill_mode="full",
                                           stop_at_eos=False)
    for tier in ("host", "disk"):  # (each component's peak: the whole reservation, before a token is stored)
        assert result.memory[tier]["peak_components"].get("kv_reserved", 0) == heads[tier] * record, tier


# -- 4-bit records (compression.py) ---------------------------------------------------------------------------------
@pytest.mark.parametrize("head_dim, bits", [(16, 6.0), (64, 4.5), (128, 4.5)])
def test_kv_bits_is_what_a_4bit_record_costs(head_dim, bits):
    """A group's codes take 4 bits a value, its fp16 scale and minimum 32 bits more (groups of 64, a narrower head
    one group): bits = (head_dim / 2 + 4 x groups) x 8 / head_dim (kvlib 16d4b36 reported 4)."""
    groups = max(1, head_dim // 64)
    assert (head_dim // 2 + 4 * groups) * 8 / head_dim == bits  # the re-statement's own arithmetic
    model = llama(head_dim)
    policy = make_policy("flexgen", compress_cache=True)
    Engine(model, policy)
    assert policy.kv_bits() == bits


# -- finish never masks start's error ---------------------------------------------------------------------------------
@pytest.mark.parametrize("head_dim", [80, 96])
def test_an_error_in_start_is_the_error_raised(tmp_path, head_dim):
    """The 4-bit codec refuses a head width that is no multiple of its group; finish, run on the way out, must not
    replace that error by its own (kvlib 16d4b36 raised AttributeError: no `store` yet)."""
    policy = make_policy("flexgen", compress_cache=True, percent="100 0 0 0 100 0", offload_dir=str(tmp_path))
    with pytest.raises(ValueError, match="group size"):
        Engine(llama(head_dim), policy).generate([list(range(10, 20))], 2, prefill_mode="full")
    policy.finish()  # (again, on a policy whose start failed: nothing to undo, no error)
    assert not list(tmp_path.glob("kvlib-offload-*"))


# -- leaked offload folders -------------------------------------------------------------------------------------------
def test_folders_of_dead_runs_are_swept_at_the_next_runs_start(tiny, tmp_path):
    """A run killed outright leaves kvlib-offload-<pid>-*; the next run in the same folder removes this user's whose
    pid is dead, and leaves a live process's and another user's (kvlib 16d4b36 swept nothing)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = tmp_path / f"kvlib-offload-{child.pid}-abc123"
    live = tmp_path / f"kvlib-offload-{os.getpid()}-def456"
    for folder in (dead, live):
        folder.mkdir()
        (folder / "keys.bin").write_bytes(b"x" * 10)
    others = []
    if os.geteuid() == 0:  # (only root can give a folder to another user)
        other = tmp_path / f"kvlib-offload-{child.pid}-other1"
        other.mkdir()
        os.chown(other, 4242, 4242)
        others.append(other)
    policy = make_policy("flexgen", percent="100 0 0 0 100 0", offload_dir=str(tmp_path))
    Engine(tiny, policy).generate(prompts_of(8), 2, prefill_mode="full", stop_at_eos=False)
    assert not dead.exists()
    assert live.exists() and all(o.exists() for o in others)


# -- CUDA: pinned memory, a side stream -------------------------------------------------------------------------------
class FakeStream:
    def __init__(self, *args):
        self.calls = []

    def wait_event(self, event):
        self.calls.append("wait_event")

    def synchronize(self):
        self.calls.append("synchronize")


class FakeEvent:
    def __init__(self, *args, **kwargs):
        self.calls = []

    def record(self, *args):
        self.calls.append("record")

    def synchronize(self):
        self.calls.append("synchronize")


def test_on_cuda_copies_run_on_a_side_stream_from_pinned_memory(monkeypatch):
    """The decision and the code path, on a CPU: a CUDA device gets pinned host buffers and a stream of the copy
    thread's own; a job waits for the compute marked before it and ends with its copies done; a pageable source is
    relayed through a pinned copy (FlexGen's general_copy), and the copy is asynchronous."""
    from contextlib import nullcontext

    from kvlib.memory import disk

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert disk.pins(cuda) and not disk.pins(cpu)
    assert disk.CopyStream(cpu).stream is None and disk.CopyStream(cpu).mark() is None
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: nullcontext())
    pinned = []

    def pin_memory(self):
        pinned.append(self.shape)
        return self.clone()
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    copies = disk.CopyStream(cuda)
    assert isinstance(copies.stream, FakeStream)
    mark = copies.mark()
    assert mark.calls == ["record"]
    with copies.job(mark):
        assert mark.calls == ["record", "synchronize"]  # the compute before it done first
    assert copies.stream.calls[-1] == "synchronize"  # its copies done before the compute thread uses them
    src, dst = torch.arange(6.0), torch.zeros(6)
    transfers = disk.Transfers()
    copies.into(dst, src, transfers)
    assert torch.equal(dst, src) and pinned == [src.shape] and transfers.bytes["host_to_device"] == src.nbytes
    assert disk.host_copy(torch.ones(3), cuda) is not None and pinned[-1] == (3,)  # a host weight pinned once


# -- measurement ------------------------------------------------------------------------------------------------------
def test_weight_waits_and_4bit_coding_are_timed_apart(fused, tmp_path):
    """Waiting for a layer's weights is a timer section of its own; the 4-bit cache's decoding and encoding are
    counted apart from the host->device and device->host seconds; the disk flush (kvlib's, not FlexGen's) too."""
    policy = make_policy("flexgen", percent="0 50 0 50 100 0", compress_cache=True, offload_dir=str(tmp_path))
    result = Engine(fused, policy).generate(prompts_of(30, 20), 4, prefill_mode="full", stop_at_eos=False)
    sections = result.metrics["sections_s"]
    assert "decode.weights_wait" in sections and "prefill.weights_wait" in sections
    stats = result.stats
    assert stats["kv_decode_s"] > 0 and stats["kv_encode_s"] > 0 and stats["disk_flush_s"] > 0
    assert stats["host_to_device_bytes"] > 0


def test_a_start_that_fails_while_placing_weights_leaves_the_model_whole(fused, tmp_path, monkeypatch):
    """The second layer's weight file cannot be made: the error is the one raised, and the first layer, emptied
    already, is put back (kvlib 16d4b36 left it empty)."""
    from kvlib.errors import UserError
    from kvlib.memory import disk

    probe = torch.tensor([list(range(10, 30))])
    with torch.no_grad():
        before = fused.model(probe).logits
    real, made = disk.OffloadFolder.file, []

    def file(self, name, nbytes):
        made.append(name)
        if len(made) == 2:
            raise UserError("the offload folder is full")
        return real(self, name, nbytes)
    monkeypatch.setattr(disk.OffloadFolder, "file", file)
    policy = make_policy("flexgen", percent="0 0 100 0 100 0", offload_dir=str(tmp_path))
    with pytest.raises(UserError, match="is full"):
        Engine(fused, policy).generate(prompts_of(8), 2, prefill_mode="full")
    with torch.no_grad():
        assert torch.equal(fused.model(probe).logits, before)
    assert not list(tmp_path.glob("kvlib-offload-*"))
