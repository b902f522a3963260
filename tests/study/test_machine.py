"""Which machine computed a row: the columns every result row carries, read once per process."""

import sys
import types

from kvlib.study import machine


def test_the_machine_columns_name_host_cpu_gpu_and_node():
    columns = machine.machine()
    assert set(columns) == {"machine_host", "machine_cpu", "machine_cpu_flags", "machine_cpu_flags_digest",
                            "machine_gpu", "machine_ray_node"}
    assert columns["machine_host"] and columns["machine_cpu"] and len(columns["machine_cpu_flags_digest"]) == 12
    assert set(columns["machine_cpu_flags"].split()) <= set(machine.RELEVANT_FLAGS)


def test_the_hardware_is_read_once_per_process():
    machine._hardware.cache_clear()
    machine.machine()
    machine.machine()
    assert machine._hardware.cache_info().misses == 1


def test_cpu_model_and_flags_on_x86_and_arm():
    x86 = {"model name": "AMD EPYC 7B13", "flags": "fpu sse4_2 avx2 avx512f"}
    assert machine.cpu_model(x86) == "AMD EPYC 7B13" and machine.cpu_flags(x86) >= {"avx2", "avx512f"}
    arm = {"CPU implementer": "0x41", "CPU part": "0xd0c", "Features": "fp asimd sve"}
    assert machine.cpu_model(arm) == "ARM implementer 0x41 part 0xd0c" and "sve" in machine.cpu_flags(arm)


def test_the_ray_node_is_named_only_under_ray(monkeypatch):
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert machine.ray_node_id() is None  # never imports Ray to find out
    context = types.SimpleNamespace(get_node_id=lambda: "node-7")
    fake = types.SimpleNamespace(is_initialized=lambda: True, get_runtime_context=lambda: context)
    monkeypatch.setitem(sys.modules, "ray", fake)
    assert machine.machine()["machine_ray_node"] == "node-7"
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: False))
    assert machine.ray_node_id() is None


def test_the_machine_limits_name_the_kernels_vector_path():
    from kvlib.kernels.library import instruction_set
    from kvlib.study.limits import TOY, measure

    assert measure(TOY, threads=1)["kernel_instruction_set"] == instruction_set()
