"""The memory ledger: peaks, capacity, and no double counting when bytes move between components."""

import pytest

from kvlib.errors import DeviceOOM
from kvlib.memory.ledger import MemoryLedger


def test_moving_reserved_bytes_into_use_fits_a_tight_capacity():
    ledger = MemoryLedger(device_capacity=100)
    ledger.add("device", "weights", 40)
    ledger.add("device", "kv_reserved", 60)
    ledger.set("device", kv=50, kv_reserved=10)  # same total: must not be counted twice
    assert ledger.total("device") == 100
    with pytest.raises(DeviceOOM) as err:
        ledger.set("device", "growing", kv=60, kv_reserved=10)
    assert err.value.where == "growing" and err.value.requested == 10
    assert ledger.current[("device", "kv")] == 50  # a refused change leaves the books as they were


def test_transient_buffers_count_towards_the_peak_and_then_go():
    ledger = MemoryLedger(device_capacity=None)
    ledger.add("device", "weights", 10)
    with ledger.transient("device", "activations", 5, where="matrix"):
        assert ledger.total("device") == 15
    snap = ledger.snapshot()["device"]
    assert snap["total_bytes"] == 10 and snap["peak_bytes"] == 15 and snap["peak_components"]["activations"] == 5
    assert ledger.snapshot()["host"]["kv_bytes"] == 0
