"""The decomposition of the paper's InfiniGen steps (kvlib.projection.decomposition): its residual is the paper's
step less the terms and is always printed; the bus sentence is read from the table, so a changed input changes it;
the official placement's bytes; a missing gather benchmark leaves a labelled parameter; the share's label names the
model and prompt lengths; the chapter's tables have named columns and no index."""

import json
import math

import pandas as pd
import pytest

from kvlib.projection import decomposition as dec
from kvlib.projection import paper_scale as scale


@pytest.fixture(scope="module")
def table():
    pytest.importorskip("aiconfigurator_core")
    return scale.projection(fetch_share=0.25, hardware_names=("h100_sxm",))


GATHER = {"rate": 4e9, "label": "a hand-set rate"}


def test_the_residual_is_the_paper_step_less_the_terms_and_is_printed(table):
    frame = dec.decomposition(table, gather=GATHER)
    terms = frame.set_index("term")
    for case in frame.columns[3:]:
        summed = terms.loc[terms.index[:terms.index.get_loc(dec.EXPLAINED)], case].sum()
        assert terms.loc[dec.EXPLAINED, case] == pytest.approx(summed)
        assert terms.loc[dec.RESIDUAL, case] == pytest.approx(terms.loc[dec.PAPER_STEP, case] - summed)
    first = frame.columns[3]
    assert terms.loc[dec.PAPER_STEP, first] == pytest.approx(1e3 / dec.PAPER_INFINIGEN_RATE)
    text = dec.sentence(frame)
    residual = terms.loc[dec.RESIDUAL, first]
    assert (f"{residual:.0f} ms the model does not explain" in text if residual >= 0
            else f"exceed the paper's step by {-residual:.0f} ms" in text)
    from kvlib.report.paper_scale import decomposition_table

    html = decomposition_table(frame, cases=list(frame.columns[3:5])).to_html()
    assert dec.RESIDUAL.replace("'", "&#x27;") in html or dec.RESIDUAL in html


def test_the_sentence_follows_the_table(table):
    base = dec.decomposition(table, gather=GATHER)
    text = dec.sentence(base)
    for case, share in dec.bus_shares(base).items():
        if case == base.columns[3] or not case.startswith("batch 1,"):
            assert f"{share['share']:.0%}-{share['practical_share']:.0%}" in text
    assert dec.sentence(dec.decomposition(table, gather=GATHER, paper_rate=4.0)) != text  # the paper's step
    assert dec.sentence(dec.decomposition(table, gather={"rate": 40e9, "label": "x"})) != text  # a gather term
    assert dec.sentence(dec.decomposition(table, gather=GATHER, practical_link=40e9)) != text  # the practical rate


def test_the_bus_carries_the_official_placement(table):
    frame = dec.decomposition(table, gather=GATHER).set_index("term")
    case = frame.columns[2]  # batch 1, 10,240 + 512
    sparse, dense = 32 - scale.INFINIGEN_DENSE_LAYERS, scale.INFINIGEN_DENSE_LAYERS
    copies_ms = 1e3 * 2 * sparse * 1e-6
    # the dense layers' whole KV against the sparse layers' share of it: dense / (sparse x share), the same tokens
    assert frame.loc[dec.BUS[1], case] / (frame.loc[dec.BUS[0], case] - copies_ms) == pytest.approx(
        dense / (sparse * scale.INFINIGEN_CAP))  # the 0.3 cap: +22 %
    assert 0 < frame.loc[dec.BUS[2], case] < frame.loc[dec.BUS[1], case]
    assert frame.loc[dec.PRACTICAL, case] == pytest.approx(
        (frame.loc[list(dec.BUS), case].sum() - copies_ms) * (64 / 53 - 1), rel=1e-3)


def test_a_missing_gather_benchmark_leaves_a_labelled_parameter(table, tmp_path):
    assert dec.gather_rate(0.3, tmp_path / "none.json") is None
    frame = dec.decomposition(table, gather={})  # an empty dict: no gather known
    row = frame.set_index("term").loc[dec.GATHER]
    assert row["kind"] == "parameter" and "missing" in row["basis"]
    assert all(math.isnan(v) for v in row.iloc[2:])
    assert "not known" in dec.sentence(frame)


def test_the_gather_rate_is_read_at_the_nearest_share(tmp_path):
    path = tmp_path / "gather.json"
    path.write_text(json.dumps({"cpu": "a CPU", "cpu_threads": 1, "gather": [
        {"share": 0.1, "way": dec.GATHER_WAY, "gb_per_s": 5.0}, {"share": 0.3, "way": dec.GATHER_WAY, "gb_per_s": 2.0},
        {"share": 0.3, "way": "another way", "gb_per_s": 9.0}]}))
    got = dec.gather_rate(0.25, path)
    assert got["rate"] == 2e9 and "measured here" in got["label"] and "a CPU" in got["label"]


def test_the_measured_share_names_its_model_and_prompt_lengths(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLIB_ROOT", str(tmp_path))
    folder = tmp_path / "results" / "embedded" / "decode_length"
    folder.mkdir(parents=True)
    run = {"policy": "infinigen", "model": "smollm2-135m", "prompt_tokens": 2048, "dense_layers": 2,
           "experiment": "decode_length", "decode_steps": 63, "stat_batching": "static",
           "stat_kv_share_attended_per_layer": [1.0, 1.0, .1, .1]}
    pd.DataFrame([run]).to_parquet(folder / "a.parquet")
    # a run that decoded no step (TTFT's) and one whose batch changed as requests came (serving's) are not read
    for name, other in (("ttft", {"decode_steps": 0}), ("serving", {"stat_batching": "continuous"})):
        (tmp_path / "results" / "embedded" / name).mkdir()
        pd.DataFrame([{**run, "experiment": name, **other, "stat_kv_share_attended_per_layer": [1.0, 1.0, .9, .9]}]
                     ).to_parquet(tmp_path / "results" / "embedded" / name / "a.parquet")
    share, source = scale.measured_fetch_share()
    assert share == pytest.approx(0.1) and "smollm2-135m" in source and "2,048-token" in source
    assert "decode_length, 1 runs" in source


def test_the_share_sensitivity_and_h2o_beside_the_paper():
    frame = dec.share_sensitivity("no-such-profile", shares=(0.1, 0.3), kernels=False)
    assert list(frame["InfiniGen's attended share"]) == [0.1, 0.3]
    rate = next(c for c in frame.columns if c.startswith("batch 1,") and "tokens/s" in c)
    assert frame[rate].iloc[0] > frame[rate].iloc[1]  # fetching less is faster
    assert all("projected" in c for c in frame.columns[2:])
    h2o = dec.h2o_beside_paper(kernels=False).set_index("figure")
    memory = next(i for i in h2o.index if i.startswith("device memory"))
    assert h2o.loc[memory, "the paper (stated)"] == "under 40"
    assert float(h2o.loc[memory, "projected, heavy + recent = 0.3"]) < float(h2o.loc[memory,
                                                                                  "projected, heavy = recent = 0.3"])


def test_the_chapters_tables_read_as_tables():
    from kvlib.report import paper_scale as report

    gauge = pd.DataFrame([{"runner": "full", "batch_size": 1, "measured_decode_s": 2.0, "decode_bound_s": 1.0,
                           "bound_as_scheduled_s": 1.0, "limited_by": "memory", "measured_over_bound": 2.0,
                           "held_every_repeat": True, "repeats": 3, "hardware": "x", "counts": "its own"}])
    for styled in (report.gauge_table(gauge), report.spec_summary(), report.spec_sources()):
        columns = list(styled.data.columns)
        assert not any("_" in c for c in columns), columns
        assert "<th class=\"blank level0\"" not in styled.to_html()  # no index column


def test_the_long_prompt_share_is_labelled_with_its_model_and_lengths(tmp_path):
    assert dec.long_prompt_share(tmp_path / "none.json")[0] is None
    path = tmp_path / "share.json"
    path.write_text(json.dumps({"model": "smollm2-135m", "budget": 0.3, "rows": [
        {"prompt_tokens": 2048, "share": 0.1}, {"prompt_tokens": 4096, "share": 0.08}]}))
    share, label = dec.long_prompt_share(path)
    assert share == pytest.approx(0.09) and "smollm2-135m" in label and "2,048" in label and "4,096" in label


def test_the_official_schedules_syncs_are_counted_layer_by_layer():
    # Llama-3.1-8B: 32 layers, 30 sparse: 66 after FlexGen's layers, 30 before attention, 60 in selection
    assert dec.official_syncs(32, 30) == 66 + 30 + 60
