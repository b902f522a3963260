"""Every figure drawn from result rows names, in its title, the model and the machine the rows come from, and every
chapter's lead says it in one sentence (kvlib.report.provenance): a reader who meets one figure out of context can tell
what produced it. Said from the rows only: a column that is absent says nothing."""

import gzip
import json
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import pytest
from chapter_rows import SYNTHETIC, accuracy_rows, batch_rows, item_rows  # tests/helpers
from paper_rows import paper_frame

from kvlib.report import batch_scaling as batch_page
from kvlib.report import decode_length as decode_page
from kvlib.report import offload, opening, timing_figures
from kvlib.report import ttft as ttft_page
from kvlib.report.accuracy import figures as accuracy_figures
from kvlib.report.accuracy import frontier
from kvlib.report.accuracy import tables as accuracy_tables
from kvlib.report.accuracy.fig7 import fig7
from kvlib.report.findings.overview import overview
from kvlib.report.provenance import provenance, sentence
from kvlib.report.serving.figures import latency_vs_rate, memory_vs_rate
from kvlib.report.study_rows import StudyRows
from kvlib.study import experiment

CPU = "Intel(R) Xeon(R) Processor"
MODEL, SHOWN = "smollm2-135m", "SmolLM2-135M-Instruct"
WHERE = {"model": MODEL, "machine_cpu": CPU, "machine_gpu": "null", "device": None, "device_name": "cpu"}


def measured(df: pd.DataFrame, **where) -> pd.DataFrame:
    """The rows as a machine records them: the model, the machine's CPU, the device they ran on."""
    return df.assign(**{**WHERE, **where})


def title_text(fig) -> str:
    """Everything the figure says above its panels: its suptitle and every panel's title."""
    heads = [fig._suptitle.get_text()] if fig._suptitle is not None else []
    return "\n".join(heads + [ax.get_title() for ax in fig.axes])


@pytest.fixture(autouse=True)
def _close():
    yield
    plt.close("all")


def test_one_model_on_one_machine_is_named_as_readme_names_it():
    assert provenance(measured(batch_rows())) == f"{SHOWN} on {CPU} (device cpu)"
    assert sentence(measured(batch_rows())) == f"Measured with {SHOWN} on {CPU} (device cpu)."


def test_two_models_are_said_to_be_several_and_listed():
    rows = pd.concat([measured(batch_rows()), measured(batch_rows(), model="qwen2.5-coder-0.5b")])
    assert provenance(rows) == f"several models ({SHOWN}, Qwen2.5-Coder-0.5B-Instruct) on {CPU} (device cpu)"
    two = pd.concat([measured(batch_rows()), measured(batch_rows(), machine_cpu="AMD EPYC 7763",
                                                       machine_gpu="NVIDIA H200", device_name="NVIDIA H200")])
    assert provenance(two) == f"{SHOWN} on several machines ({CPU}, AMD EPYC 7763 with NVIDIA H200) (device cpu)"


def test_a_model_not_embedded_is_named_as_the_rows_have_it():
    assert provenance(measured(batch_rows(), model="org/some-model")).startswith("org/some-model on ")


def test_an_absent_column_says_nothing_rather_than_guess():
    rows = measured(batch_rows()).drop(columns=["machine_cpu", "machine_gpu", "device", "device_name"])
    assert provenance(rows) == SHOWN and sentence(rows) == f"Measured with {SHOWN}."
    assert provenance(measured(batch_rows()).drop(columns="model")) == f"on {CPU} (device cpu)"
    assert provenance(batch_rows()) == "" and sentence(batch_rows()) == ""


def test_the_timing_figures_name_model_and_machine():
    rows = measured(batch_rows())
    ttft = rows.assign(prompt_tokens=rows["batch_size"] * 256, prefill="full", ttft_s=rows["batch_size"] * 0.1)
    for fig in (batch_page.figure(rows), decode_page.figure(rows.rename(columns={"batch_size": "output_tokens"})),
                ttft_page.figure(ttft), timing_figures.memory_components(rows.assign(device_kv_peak_bytes=2**20), by="batch_size"),
                overview(StudyRows(batch_scaling=rows, accuracy=measured(accuracy_rows())))):
        assert SHOWN in title_text(fig) and CPU in title_text(fig), title_text(fig)
    assert f"{SHOWN} on {CPU}" not in title_text(batch_page.figure(batch_rows()))  # the rows record neither


def test_the_timing_figures_name_the_repeats_their_bars_span_and_claim_no_range_of_one():
    rows = measured(batch_rows())
    ttft = rows.assign(prompt_tokens=rows["batch_size"] * 256, prefill="full", ttft_s=rows["batch_size"] * 0.1)
    decode = rows.rename(columns={"batch_size": "output_tokens"})
    once = [frame[frame["repeat"] == 0] for frame in (rows, ttft, decode)]
    assert "bars: range of 8 repeats and their steps" in title_text(batch_page.figure(rows))
    assert "band: range of 8 repeats" in title_text(ttft_page.figure(ttft))
    assert "bars: range of 8 repeats and their steps" in title_text(decode_page.figure(decode))
    titles = [title_text(batch_page.figure(once[0])), title_text(ttft_page.figure(once[1])),
              title_text(decode_page.figure(once[2]))]
    assert not any("range of" in t for t in titles), titles
    assert "1 repeat: no band" in titles[1] and all("1 repeat; bars: its steps' quartiles" in t for t in titles[::2])
    assert any("(and the range of 8 runs)." in line for line in ttft_page.lines(ttft))
    assert any(line.endswith("s (one run).") for line in ttft_page.lines(once[1]))
    assert not any("range of 1 runs" in line for line in ttft_page.lines(once[1]))


def test_the_ttft_figure_draws_no_prefill_mode_with_the_x_its_title_keeps_for_out_of_memory():
    rows = measured(batch_rows())
    ttft = pd.concat([rows.assign(prompt_tokens=rows["batch_size"] * 256, prefill=mode, ttft_s=rows["batch_size"] * 0.1)
                      for mode in ("chunked", "full", "fused")])
    ax = ttft_page.figure(ttft).axes[0]
    assert {line.get_marker() for line in ax.get_lines()} & {"x", "X"} == set()
    assert [c.get_label() for c in ax.collections if c.get_label() == "OOM"] == ["OOM"]  # kivi's row ran out


def test_the_accuracy_figures_name_model_and_machine():
    own = measured(accuracy_rows()).assign(kv_share_attended=0.5, length=512)
    own["correct"] = own["correct"].where(own["doc_id"] % 7 > 0, 0.0)  # no perfect score: its interval is [x, 1]
    scores = accuracy_tables.accuracy_table(own)
    assert CPU not in title_text(accuracy_figures.accuracy(scores))  # the table keeps no machine: only its rows say it
    assert f"{SHOWN} on {CPU}" in title_text(accuracy_figures.accuracy(scores, rows=own))
    assert f"{SHOWN} on {CPU}" in title_text(accuracy_figures.recall_by_length(own.assign(task="kvlib_recall")))
    paper = measured(paper_frame(items=40, tasks=("piqa", "copa")))
    assert f"{SHOWN} on {CPU}" in title_text(fig7(paper))
    held = measured(pd.DataFrame(item_rows("full", float("nan"), set(), 1.0)
                                 + item_rows("h2o", 0.1, set(range(30)), 0.1)), model=MODEL)
    assert f"{SHOWN} on {CPU}" in title_text(frontier.plot(held))


def test_the_offload_and_serving_figures_name_model_and_machine():
    with gzip.open(Path(__file__).parents[1] / "data" / "smoke_rows" / "offload.json.gz", "rt") as f:
        rows = measured(pd.DataFrame(json.load(f)["rows"]))
    rows = rows.assign(decode_tokens_per_s=10.0, disk_read_bytes_per_s=1e9, stat_disk_to_host_bytes_in_decode=2**20)
    assert f"{SHOWN} on {CPU}" in title_text(offload.figure(rows))
    for fig in (latency_vs_rate(measured(SYNTHETIC)), memory_vs_rate(measured(SYNTHETIC))):
        assert f"{SHOWN} on {CPU}" in title_text(fig)


def test_each_chapters_lead_names_its_rows_model_and_machine_and_keeps_its_words():
    rows = measured(batch_rows())
    text = experiment("batch_scaling").answer(rows)
    bare = experiment("batch_scaling").answer(batch_rows())
    assert f"Measured with {SHOWN} on {CPU} (device cpu).\n\n" in text
    assert text.replace(f" Measured with {SHOWN} on {CPU} (device cpu).", "") == bare  # no verdict word changed
    assert f"Measured with {SHOWN}" in experiment("accuracy").answer(measured(accuracy_rows()))
    assert experiment("decode_length").answer(measured(pd.DataFrame())) == f"**In short.** {opening.NOTHING}"
