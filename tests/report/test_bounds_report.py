"""The chapter's gauge (kvlib.report.bounds, kvlib.report.paper_scale): measured / bound per runner, the real vLLM
read against full's counts at the same point, and the bound read only against the limits of the machine that timed
the rows (recorded by the study before it times anything)."""

import json

import pandas as pd

from kvlib.hardware import Figure, Spec
from kvlib.memory.work import QUANTITIES
from kvlib.report import bounds, paper_scale


def spec() -> Spec:
    return Spec(name="hand", description="by hand", memory_bandwidth=Figure(100.0, "hand"),
                peak_flops={"float32": Figure(1e6, "hand")}, device_memory=Figure(1e3, "hand"), link_bandwidth=None,
                link_latency=None, disk_bandwidth=Figure(None, "unknown"))


def row(policy, batch, decode_s, weight_bytes=None, outside=False):
    counts = {} if weight_bytes is None else {f"stat_work_decode_{q}": 0 for q in QUANTITIES} | {
        "stat_work_decode_passes": 4, "stat_work_decode_weight_bytes": weight_bytes}
    return {"policy": policy, "runner": policy.split(" ")[0], "outside": outside, "batch_size": batch, "oom": False,
            "decode_s": decode_s, "machine_cpu": "Hand CPU", **counts}


def test_measured_over_bound_per_runner_with_vllm_on_fulls_counts():
    df = pd.DataFrame([row("full", 1, 3.0, 100), row("full", 1, 5.0, 100), row("h2o", 1, 0.5, 100),
                       row("vllm (real)", 1, 2.0, outside=True)])
    table = bounds.measured_over_bound(df, spec()).set_index("runner")
    assert table.loc["full", "decode_bound_s"] == 1.0 and table.loc["full", "measured_over_bound"] == 4.0
    assert table.loc["full", "repeats"] == 2 and table.loc["full", "held_every_repeat"]
    assert not table.loc["h2o", "held_every_repeat"]  # 0.5 s for work that needs 1 s: a limit or a count is wrong
    assert table.loc["vllm", "measured_over_bound"] == 2.0
    assert table.loc["vllm", "counts"] == "full's, at the same point"
    text = paper_scale.gauge_text(table.reset_index(), df)
    assert "at batch 1: 0.5-4.0x their bound" in text and "the bound was above a measurement for h2o" in text


def test_the_bound_is_read_only_against_the_machine_that_timed_the_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLIB_ROOT", str(tmp_path))
    df = pd.DataFrame([row("full", 1, 3.0, 100)])
    assert "No limits recorded" in paper_scale.machine_text("mine", df) and paper_scale.gauge(df, "mine").empty
    limits = tmp_path / "results" / "mine" / "machine.json"
    limits.parent.mkdir(parents=True)
    limits.write_text(json.dumps({"read_gb_per_s": 10.0, "matmul_fp32_gflop_per_s": 100.0, "machine_cpu": "Hand CPU"}))
    assert paper_scale.machine_text("mine", df).endswith("host and device one memory).")
    assert paper_scale.gauge(df, "mine")["measured_decode_s"].tolist() == [3.0]
    other = df.assign(machine_cpu="Another CPU")
    assert "the bound may not be theirs" in paper_scale.machine_text("mine", other)
