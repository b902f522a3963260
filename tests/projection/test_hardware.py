"""Machines as data (kvlib.hardware): every shipped spec loads with a source for every figure, a user's file loads
as a shipped one does, bad files are refused with the figure named, and this machine's spec is built from
bench_machine.py's measures whatever else they carry."""

import json

import pytest

from kvlib import hardware
from kvlib.errors import UserError

SHIPPED = ["a100_sxm", "gh200", "h100_pcie", "h100_sxm", "l4"]


def test_the_shipped_specs_are_listed_with_this_machine():
    assert hardware.names() == sorted(SHIPPED + ["this_machine"])


@pytest.mark.parametrize("name", SHIPPED)
def test_every_figure_of_a_shipped_spec_has_a_value_and_a_source(name):
    spec = hardware.load(name)
    assert spec.name == name and not spec.unified
    for figure_name, figure in spec.figures().items():
        assert figure.source.strip(), figure_name
        assert figure.value is None or figure.value > 0, figure_name
    for needed in ("memory_bandwidth", "device_memory", "link.bandwidth", "link.latency", "peak_flops.bfloat16"):
        assert spec.figures()[needed].value, needed
    assert set(spec.table().columns) == {"hardware", "figure", "value", "source"}


def test_the_datasheet_links_each_way():
    assert hardware.load("h100_sxm").link_bandwidth.value == 64e9  # PCIe 5 x16: 128 GB/s both ways together
    assert hardware.load("a100_sxm").link_bandwidth.value == 32e9  # PCIe 4
    gh200 = hardware.load("gh200")
    assert gh200.link_bandwidth.value == 450e9  # NVLink-C2C: 900 GB/s both ways together
    assert gh200.kernel_system == "h100_sxm" and "H100" in gh200.kernel_source


SPEC = """
name: mine
description: a test machine
memory_bandwidth: {value: 1.0e+11, source: my measurement}
peak_flops: {bfloat16: {value: 2.0e+13, source: my datasheet}}
device_memory: {value: 2.4e+10, source: my datasheet}
link: unified
"""


def test_a_users_file_loads_and_a_unified_link_has_no_bus(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(SPEC)
    spec = hardware.load(path)
    assert spec.name == "mine" and spec.unified and spec.link_bandwidth is None
    assert spec.peak("bfloat16") == 2e13 and spec.peak("float32") == 2e13  # no figure: the highest, still a bound
    assert spec.disk_bandwidth.value is None


def test_a_figure_without_a_source_is_refused(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(SPEC.replace("source: my measurement", "source: ''"))
    with pytest.raises(UserError, match="memory_bandwidth needs a value and a source"):
        hardware.load(path)


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(UserError, match="h100_sxm"):
        hardware.load("h9000")
    with pytest.raises(UserError, match="no such file"):
        hardware.load("/nonexistent/spec.yaml")


def test_this_machine_from_bench_machines_keys_and_more(tmp_path):
    path = tmp_path / "machine.json"
    path.write_text(json.dumps({"threads": 2, "read_gb_per_s": 20.0, "matmul_fp32_gflop_per_s": 100.0,
                                "decode_linears_16_rows": {"gflop_per_s": 150.0, "weights_gb_per_s": 10.0},
                                "cuda": {"anything": "a later bench_machine.py adds"}}))
    spec = hardware.this_machine(path)
    assert spec.unified and spec.name == "this_machine"
    assert spec.memory_bandwidth.value == 20e9  # the highest read rate measured
    assert spec.peak("float32") == 150e9  # the decode-shaped linears beat the big matmul here: the highest
    assert "bench_machine.py" in spec.memory_bandwidth.source
    path.write_text(json.dumps({"threads": 2}))
    with pytest.raises(UserError, match="read_gb_per_s"):
        hardware.this_machine(path)
    with pytest.raises(UserError, match="bench_machine.py"):
        hardware.this_machine(tmp_path / "missing.json")
