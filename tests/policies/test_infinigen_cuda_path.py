"""InfiniGen's CUDA copy path, run on a CPU with CUDA's parts faked (a side stream, its events, pinned memory): each
fetch gathers into one reused pinned buffer and copies from it, without blocking, on the side stream; the layer that
reads the entries waits for that copy's event first; the buffer is not overwritten before its last copy has landed.
What the run generates is what the CPU's own copy path generates."""

from contextlib import contextmanager

import pytest
import torch

from kvlib.engine import Engine
from kvlib.policies import make_policy

PROMPTS = [list(range(500, 560)), list(range(700, 740))]
SETTINGS = {"budget": 0.5, "alpha": 2.0, "fetch": True}  # real selections: fewer entries than the cache, per row


class FakeEvent:
    def __init__(self, log):
        self.log = log

    def synchronize(self):
        self.log.append(("host waits", self))


class FakeStream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def record_event(self):
        event = FakeEvent(self.log)
        self.log.append(("record", self.name, event))
        return event

    def wait_event(self, event):
        self.log.append(("device waits", self.name, event))

    def wait_stream(self, stream):
        self.log.append(("device waits", self.name, stream))


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA's copy machinery on a CPU: what the policy does with it, in order, in `log`; what it pinned in `pinned`."""
    log, pinned, on = [], [], {"stream": "compute"}
    side, compute = FakeStream(log, "side"), FakeStream(log, "compute")

    @contextmanager
    def stream(s):
        on["stream"] = s.name
        try:
            yield
        finally:
            on["stream"] = "compute"

    real_empty, real_to = torch.empty, torch.Tensor.to

    def empty(*args, pin_memory=False, **kwargs):
        t = real_empty(*args, **kwargs)
        if pin_memory:
            pinned.append(t)
        return t

    def to(self, *args, non_blocking=False, **kwargs):
        if non_blocking:
            log.append(("copy", on["stream"], self))
        return real_to(self, *args, non_blocking=non_blocking, **kwargs)

    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: compute)
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: log.append(("record_stream", s.name)))
    return side, log, pinned


def on_fake_cuda(policy, side, log):
    """The policy as started on CUDA (its side stream), each decode read of a layer logged."""
    start, attention = policy.start, policy.decode_attention

    def start_on_cuda(*args, **kwargs):
        start(*args, **kwargs)
        policy.stream = side

    def logged(layer, query, reads):
        log.append(("read", layer))
        return attention(layer, query, reads)

    policy.start, policy.decode_attention = start_on_cuda, logged
    return policy


def within(t: torch.Tensor, buffers: list[torch.Tensor]) -> bool:
    return any(b.data_ptr() <= t.data_ptr() < b.data_ptr() + b.nbytes for b in buffers)


def test_fetches_copy_from_a_pinned_buffer_on_a_side_stream(tiny, fake_cuda):
    side, log, pinned = fake_cuda
    policy = on_fake_cuda(make_policy("infinigen", **SETTINGS), side, log)
    result = Engine(tiny, policy).generate(PROMPTS, 5, stop_at_eos=False)

    copies = [entry for entry in log if entry[0] == "copy"]
    sparse, steps = tiny.spec.num_layers - 2, 4
    assert len(copies) == 2 * sparse * steps  # keys and values, each sparse layer, each decode step
    assert all(stream == "side" for _, stream, _ in copies)
    assert all(within(source, pinned) for _, _, source in copies), "a copy from pageable memory"
    assert len(pinned) <= 1 + steps  # one buffer, grown now and then, never one a fetch

    # each sparse layer's read comes after its own copy's event has been waited for on the device
    reads = [i for i, entry in enumerate(log) if entry[0] == "read" and entry[1] >= 2]
    assert len(reads) == sparse * steps
    for at in reads:
        recorded = next(e for e in reversed(log[:at]) if e[0] == "record")
        waited = [e for e in log[log.index(recorded):at] if e[0] == "device waits"]
        assert [e[2] for e in waited] == [recorded[2]]
    # the buffer is overwritten (a fetch's gather, before its first copy) only once the last copy out of it landed
    firsts = [i for i, entry in enumerate(log) if entry[0] == "copy" and log[i - 1][0] != "copy"]
    assert len(firsts) == sparse * steps
    for at in firsts[1:]:
        recorded = next(e for e in reversed(log[:at]) if e[0] == "record")
        assert ("host waits", recorded[2]) in log[log.index(recorded):at]

    plain = Engine(tiny, make_policy("infinigen", **SETTINGS)).generate(PROMPTS, 5, stop_at_eos=False)
    assert [o["token_ids"] for o in result.outputs] == [o["token_ids"] for o in plain.outputs]
    assert result.stats["bytes_moved_host_to_device"] == plain.stats["bytes_moved_host_to_device"]


def test_the_write_back_is_counted(tiny):
    """Every new key and value of a sparse layer goes to the host tier: counted as crossing it, prefill and decode."""
    result = Engine(tiny, make_policy("infinigen", budget=0.5)).generate(PROMPTS, 5, stop_at_eos=False)
    s = tiny.spec
    token = 2 * s.num_kv_heads * s.head_dim * 4 * (s.num_layers - 2)  # keys and values of the sparse layers, fp32
    assert result.stats["work_prefill_device_to_host_bytes"] == sum(map(len, PROMPTS)) * token
    assert result.stats["work_decode_device_to_host_bytes"] == 4 * len(PROMPTS) * token
