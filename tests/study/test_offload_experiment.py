"""The offload experiment (FlexGen's placements in the study) and its chapter's reading: real runs on SmolLM2 at a
device capacity the full cache runs out of, and the sentences, table and figure read from their rows."""

import matplotlib
import pandas as pd
import pytest
import yaml

from kvlib import study
from kvlib.engine.scheduler import BATCHING
from kvlib.report import offload
from kvlib.report.study_rows import StudyRows
from kvlib.study import executor, experiment, results

matplotlib.use("Agg")

# SmolLM2's weights and packed head take 0.61 GiB: in 0.635 GiB the full cache of 4 x 258 tokens (0.045 GiB) does not
# fit beside them, while FlexGen's staging layers and H2O's full-matrix prefill do
PROFILE = {"model": "smollm2-135m", "device_capacity_gb": 0.635, "policy_settings": {},
           "experiments": {"offload": {"policies": ["full", "flexgen", "flexgen_h2o"],
                                       "grid": {"percent": ["100 0 0 100 100 0", "100 0 0 0 100 0"]},
                                       "fixed": {"batch_size": 4, "prompt_tokens": 256, "max_new_tokens": 2}}}}


@pytest.fixture(scope="module")
def frame(tmp_path_factory):
    root = tmp_path_factory.mktemp("study")
    (root / "params").mkdir()
    profile = yaml.safe_load(yaml.safe_dump(PROFILE))
    profile["experiments"]["offload"]["fixed"]["offload_dir"] = str(root / "offload")
    (root / "params" / "p.yaml").write_text(yaml.safe_dump(profile))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVLIB_ROOT", str(root))
        executor.run_experiment(study.load_profile("p"), "offload", progress=False)
        yield results.load("p", "offload")


def test_full_runs_out_where_the_offloaded_runners_complete_and_disk_reads_are_counted(frame):
    d = offload.frame(frame)
    full = d[d["policy"] == "full"]
    assert full["oom"].all()
    placed = d[d["policy"] != "full"]
    assert not placed["oom"].any() and (placed["device_peak_bytes"] <= 0.635 * 2**30).all()
    on_disk = placed[placed["kv_on_disk"] == 1.0]
    on_host = placed[placed["kv_on_disk"] == 0.0]
    assert (on_disk["disk_bytes_per_token"] > 0).all() and (on_host["disk_bytes_per_token"] == 0).all()
    assert (on_disk["disk_peak_bytes"] > 0).all() and (on_host["host_peak_bytes"] > 0).all()
    assert (d["disk_read_bytes_per_s"] > 0).all()
    # FlexGen + H2O keeps 0.6 of the prompt: it reads less off the disk a token than FlexGen keeping every entry
    per_token = on_disk.set_index("policy")["disk_bytes_per_token"]
    assert per_token["flexgen+h2o"] < per_token["flexgen"]


def test_the_chapter_says_who_ran_out_and_what_the_others_held_per_tier(frame):
    text = experiment("offload").answer(frame)
    assert "full ran out of memory" in text
    for policy in ("flexgen", "flexgen+h2o"):
        assert f"{policy} completed with its KV off the device" in text
        assert f"{policy} " in text.split("as the disk takes the KV:")[1]
    assert "too few repeats for an interval" in text
    table = offload.table(frame)
    assert table.loc[("full", "all on the device"), "completed"] == "out of device memory"
    assert (table.drop(index="full", level="runner")["completed"] == "yes").all()
    offload.figure(frame)


def test_a_placement_is_read_back_from_flexgens_percentages():
    assert offload.placement("100 0 0 50 100 0") == {"kv_on_disk": 0.5, "kv_off_device": 1.0, "weights_on": "device",
                                                     "placement": "KV 50% host, 50% disk"}
    assert offload.placement("0 0 0 0 100 0")["placement"] == "KV 100% disk; weights disk"
    assert offload.placement(None)["placement"] == "all on the device"
    assert "Nothing was measured" in experiment("offload").answer(pd.DataFrame())


def test_the_posters_table_is_filled_from_the_runs(frame):
    from kvlib.report.findings import systems


    t = systems.table(StudyRows(offload=frame))
    assert set(t.index) == {"flexgen", "flexgen+h2o"}  # full ran out of memory: no completed run to read
    held = t["KV held (peak, over its runs)"]
    assert all("host" in held[p] and "disk" in held[p] for p in t.index)
    assert t.loc["flexgen", "keeps"] == "every entry" and t.loc["flexgen+h2o", "evicts"].startswith("the least")
    assert t.loc["flexgen", "bits a stored element"] == "32"
    assert (t["batching"] == BATCHING["static"]).all()  # the schedule the offload experiment ran them under
    read = t["share of seen entries decode read"]
    assert read["flexgen"] == 1.0 and read["flexgen+h2o"] < 1.0
    parts = systems.by_part(t)  # the page's two narrower tables hold every column once
    assert sorted(c for part in parts.values() for c in part.columns) == sorted(t.columns)
