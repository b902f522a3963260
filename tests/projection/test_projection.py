"""The bound (kvlib.projection.bound) equals the hand computation on a hand-made spec; bound_check tells a measured
time above its bound from one below it; aiconfigurator's GPU step is its own decode step where a policy adds nothing;
the paper-scale projection has its columns, labels every figure projected, and answers the paper's question."""

import math

import pandas as pd
import pytest

from kvlib.engine.engine import Engine
from kvlib.hardware import Figure, Spec
from kvlib.memory.work import QUANTITIES
from kvlib.policies.registry import make_policy
from kvlib.projection import bound
from kvlib.projection import paper_scale as scale


def spec(unified=False) -> Spec:
    """100 B/s of memory, 10 FLOP/s, a 10 B/s link with 1 s per transfer: round numbers to compute by hand."""
    return Spec(name="hand", description="by hand", memory_bandwidth=Figure(100.0, "hand"),
                peak_flops={"float32": Figure(10.0, "hand")}, device_memory=Figure(1e3, "hand"),
                link_bandwidth=None if unified else Figure(10.0, "hand"),
                link_latency=None if unified else Figure(1.0, "hand"), disk_bandwidth=Figure(None, "unknown"))


def work(**amounts) -> dict:
    return {f"work_decode_{q}": amounts.get(q, 0) for q in QUANTITIES}


def test_a_memory_bound_step():
    stats = work(passes=2, weight_bytes=600, kv_read_bytes=300, select_read_bytes=100, linear_flops=20)
    b = bound.phase_bound(stats, spec())
    assert (b["memory_s"], b["compute_s"], b["transfer_s"]) == (10.0, 2.0, 0.0)
    assert b["bound_s"] == b["bound_as_scheduled_s"] == 10.0 and b["bound_per_pass_s"] == 5.0


def test_a_compute_bound_step():
    b = bound.phase_bound(work(passes=1, weight_bytes=100, linear_flops=300, attention_flops=150, select_flops=50),
                          spec())
    assert (b["memory_s"], b["compute_s"], b["bound_s"]) == (1.0, 50.0, 50.0)


def test_transfers_overlap_or_serialize_as_the_policy_runs():
    stats = work(passes=1, weight_bytes=1000, host_to_device_bytes=50, host_to_device_transfers=2,
                 device_to_host_bytes=10, device_to_host_transfers=1)
    assert bound.phase_bound(stats, spec())["transfer_s"] == 5 + 2 + 1 + 1
    full, infinigen = bound.phase_bound(stats, spec(), policy="full"), bound.phase_bound(stats, spec(),
                                                                                         policy="infinigen")
    assert full["bound_s"] == full["bound_as_scheduled_s"] == 10.0  # max(10, 9)
    assert infinigen["bound_s"] == 10.0 and infinigen["bound_as_scheduled_s"] == 19.0  # kvlib's InfiniGen serializes
    assert bound.phase_bound(stats, spec(), policy="flexgen")["bound_as_scheduled_s"] == 10.0


def test_a_unified_link_charges_no_transfer():
    stats = work(passes=1, weight_bytes=1000, host_to_device_bytes=10**6, host_to_device_transfers=100)
    b = bound.phase_bound(stats, spec(unified=True), policy="infinigen")
    assert b["transfer_s"] == 0 and b["bound_as_scheduled_s"] == 10.0


def test_a_result_rows_columns_read_as_the_stats():
    stats = work(passes=1, weight_bytes=1000)
    row = {f"stat_{key}": value for key, value in stats.items()}
    assert bound.phase_bound(row, spec()) == bound.phase_bound(stats, spec())
    with pytest.raises(KeyError):
        bound.phase_bound({"decode_s": 1.0}, spec())


def test_bound_check_tells_a_time_above_its_bound_from_one_below():
    base = {"runner": "full", "policy": "full", "batch_size": 1,
            **{f"stat_{k}": v for k, v in work(passes=2, weight_bytes=1000).items()}}
    rows = [base | {"decode_s": 12.0}, base | {"decode_s": 8.0}, {"runner": "vllm", "decode_s": 1.0}]
    checked = bound.bound_check(rows, spec())
    assert len(checked) == 2  # the row without counts is left out
    assert checked.holds.tolist() == [True, False]
    assert checked.measured_over_bound.tolist() == [1.2, 0.8]
    assert checked.bound_limited_by.tolist() == ["memory", "memory"]


def test_a_real_runs_bound_is_its_counts_over_the_spec(tiny):
    """Not timed: the bound of a real short run is computed from its counted work as by hand."""
    policy = make_policy("infinigen", budget=0.5)
    stats = Engine(tiny, policy, calibration=list(range(100, 164))).generate(
        [list(range(10, 43))], 4, stop_at_eos=False).stats
    b = bound.phase_bound(stats, spec(), policy="infinigen")
    read = stats["work_decode_weight_bytes"] + stats["work_decode_kv_read_bytes"] + stats["work_decode_select_read_bytes"]
    moved = sum(stats[f"work_decode_{d}_bytes"] / 10 + stats[f"work_decode_{d}_transfers"]  # the fetch, the write-back
                for d in ("host_to_device", "device_to_host"))
    assert stats["work_decode_device_to_host_bytes"] > 0
    assert math.isclose(b["memory_s"], read / 100) and math.isclose(b["transfer_s"], moved)
    assert b["bound_as_scheduled_s"] == pytest.approx(max(b["memory_s"], b["compute_s"]) + moved)
    assert bound.phase_bound(stats, spec(unified=True), policy="infinigen")["transfer_s"] == 0


def test_aiconfigurators_step_is_its_own_where_a_policy_adds_nothing():
    pytest.importorskip("aiconfigurator_core")
    from kvlib import hardware
    from kvlib.projection import gpu_kernels

    h100 = hardware.load("h100_sxm")
    nothing = dict.fromkeys(QUANTITIES, 0)
    step = gpu_kernels.policy_step("llama-3.1-8b", h100, nothing, 1, 10240)
    own = gpu_kernels.engine("llama-3.1-8b", "h100_sxm").decode_step_latency(1, 10240, 2)
    assert step["step_serialized_ms"] == pytest.approx(own, rel=0.01)
    assert step["aiconfigurator_version"] and step["kernel_data_version"].startswith("vllm ")
    moving = nothing | {"host_to_device_bytes": 64e6, "host_to_device_transfers": 10}  # 1 ms over PCIe 5 + 10 us
    moved = gpu_kernels.policy_step("llama-3.1-8b", h100, moving, 1, 10240)
    assert moved["transfer_ms"] == pytest.approx(1.01)
    assert moved["step_serialized_ms"] == pytest.approx(own + 1.01, rel=0.01)
    assert moved["step_overlapped_ms"] == pytest.approx(own, rel=0.01)


def test_the_paper_rules_at_the_shape():
    from kvlib.models import model_config
    from kvlib.models.pass_shape import PassShape

    config = model_config("llama-3.1-8b")
    shape = PassShape.of(config, 2)
    load = scale.Workload("decode length", 2, 10240, 512)
    full = scale.step_work(shape, config.hidden_size, scale.Runner("full", "full"), load)
    assert full.work == scale.with_zeros(shape.decode_step(2, load.mean_held))
    h2o = scale.step_work(shape, config.hidden_size, scale.Runner("h2o", "h2o"), load)
    assert h2o.kv_length == 2 * int(0.3 * 10240) + 1  # heavy = recent = int(0.3 x prompt), and the new token
    infinigen = scale.step_work(shape, config.hidden_size, scale.Runner("ig", "infinigen", 0.25), load)
    sparse = shape.num_layers - scale.INFINIGEN_DENSE_LAYERS
    assert infinigen.work["host_to_device_bytes"] == pytest.approx(
        sparse * 2 * shape.num_kv_heads * 0.25 * load.mean_held * shape.kv_token_bytes)
    assert infinigen.work["host_to_device_transfers"] == 2 * sparse


@pytest.fixture(scope="module")
def projected():
    pytest.importorskip("aiconfigurator_core")
    return scale.projection(fetch_share=0.25)


def test_the_paper_scale_table_labels_every_figure_projected(projected):
    inputs = {"setting", "hardware", "runner", "policy", "batch_size", "prompt_tokens", "output_tokens",
              "attended_tokens", "fetch_share", "fetch_share_source", "hardware_spec", "aiconfigurator_version",
              "kernel_system", "kernel_data_version", "kernel_silicon_share"}
    figures = set(projected.columns) - inputs
    assert figures and all(column.endswith("_projected") for column in figures), figures
    for column in ("decode_tokens_per_s_bound_projected", "decode_tokens_per_s_projected", "device_gb_projected",
                   "host_gb_projected", "decode_step_overlapped_ms_projected"):
        assert column in projected
    assert set(projected.hardware) == {"h100_sxm", "gh200"}
    assert set(projected.runner) == {"full", "paged", "h2o", "infinigen (given share)", "infinigen (0.3 cap)"}
    assert (projected.kernel_data_version == "vllm 0.24.0").all()


def test_infinigen_is_slower_over_pcie_and_nvlink_c2c_closes_part_of_the_gap(projected):
    from kvlib.projection import paper_answer

    for hardware in ("h100_sxm", "gh200"):
        rows = projected[projected.hardware == hardware].set_index(["setting", "batch_size", "output_tokens"])
        full = rows[rows.runner == "full"].decode_tokens_per_s_projected
        infinigen = rows[rows.runner == "infinigen (0.3 cap)"].decode_tokens_per_s_projected
        assert (infinigen < full).all(), hardware
    pcie = paper_answer.gaps(projected, "h100_sxm")
    c2c = paper_answer.gaps(projected, "gh200", batches=pcie["batch"].index)
    assert (c2c["batch"] < pcie["batch"]).all() and 1 < c2c["length"] < pcie["length"]
    sentence = paper_answer.bus_sentence(projected)
    assert f"{pcie['length']:.1f}x" in sentence and "NVLink-C2C" in sentence and "projected" in sentence
    figures = paper_answer.paper_figures(projected)
    assert set(figures.figure) == set(paper_answer.PAPER)
    assert {"projected (bound)", "projected (aiconfigurator)", "paper (stated)"} <= set(figures.columns)


def test_memory_by_tier_at_the_shape(projected):
    top = projected[(projected.setting == "batch scaling") & (projected.batch_size == 96)
                    & (projected.hardware == "h100_sxm")].set_index("runner")
    assert not top.loc["paged", "fits_device_projected"]  # 96 rows of ~6K tokens: more than 80 GB
    assert top.loc["h2o", "device_gb_projected"] < top.loc["paged", "device_gb_projected"]
    assert top.loc["paged", "host_gb_projected"] == 0 < top.loc["infinigen (0.3 cap)", "host_gb_projected"]


def test_the_bound_alone_needs_no_aiconfigurator():
    table = scale.projection(fetch_share=0.25, hardware_names=("h100_sxm",), kernels=False)
    assert "decode_tokens_per_s_projected" not in table
    assert (table.decode_tokens_per_s_bound_projected > 0).all()


def test_the_measured_fetch_share_is_read_past_the_dense_layers(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLIB_ROOT", str(tmp_path))
    assert scale.measured_fetch_share()[0] is None
    folder = tmp_path / "results" / "embedded" / "batch_scaling"
    folder.mkdir(parents=True)
    run = {"experiment": "batch_scaling", "decode_steps": 15, "stat_batching": "static"}
    pd.DataFrame([{**run, "policy": "infinigen", "dense_layers": 2, "stat_kv_share_attended_per_layer": [1.0, 1.0, .2, .4]},
                  {**run, "policy": "full", "dense_layers": None, "stat_kv_share_attended_per_layer": [1.0] * 4}]
                 ).to_parquet(folder / "a.parquet")
    share, source = scale.measured_fetch_share()
    assert share == pytest.approx(0.3) and "1 InfiniGen runs" in source
