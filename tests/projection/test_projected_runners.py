"""`kvlib choose --hardware`: every runner of the profile's systems experiments projected, each from its policy's own
rule (kvlib.projection.policy_step), or a row that says why not; the user's memory limit applied; within 100 columns."""

from types import SimpleNamespace

import pytest

from kvlib.paths import repo_root
from kvlib.projection import paper_scale as scale
from kvlib.projection import policy_step
from kvlib.projection import your_workload as yours
from kvlib.study.profile import load_profile

LONG = scale.Workload("your workload", 4, 8192, 256)
SYSTEMS = load_profile("embedded", repo_root()).systems_runners()


@pytest.fixture(scope="module")
def shape():
    from kvlib.models import model_config
    from kvlib.models.pass_shape import PassShape

    config = model_config(scale.MODEL)
    return config, PassShape.of(config, scale.DTYPE_BYTES)


def runner(policy: str, **settings) -> scale.Runner:
    return scale.Runner(policy, policy, settings=tuple(sorted(settings.items())))


def step(shape, r: scale.Runner, load=LONG) -> dict:
    config, s = shape
    return scale.step_work(s, config.hidden_size, r, load).work


def memory(shape, r: scale.Runner, load=LONG) -> dict:
    config, s = shape
    return scale.memory_by_tier(s, config, r, load)


def test_every_systems_runner_of_the_embedded_profile_has_a_projected_row_or_a_reason():
    wanted = {policy for _, policy, _ in SYSTEMS}
    assert {"full", "paged", "h2o", "infinigen", "streaming", "snapkv", "quest", "kivi", "flexgen", "flexgen_h2o",
            "vllm"} <= wanted
    table = scale.projection(hardware_names=("h100_sxm",), kernels=False, loads=[LONG],
                             runner_list=yours.workload_runners("embedded", SYSTEMS))
    assert wanted <= set(table.policy)
    for _, row in table.iterrows():
        projected = row.decode_tokens_per_s_bound_projected
        assert (isinstance(projected, float) and projected > 0) or isinstance(row.get("not_projected"), str), row.runner
    text = yours.workload_text(table)
    assert text.count("\n- ") == len(table)  # one line a runner, none dropped


def test_a_runner_whose_step_has_no_rule_says_so_instead_of_vanishing(monkeypatch):
    monkeypatch.setattr(scale, "_POLICIES", {})
    monkeypatch.setattr(policy_step, "policy_at", lambda *a: SimpleNamespace(name="odd", lossless=False))
    monkeypatch.setattr(scale, "measured", lambda profile: (None, "no measured InfiniGen rows in nowhere", None))
    runners = scale.runners(profile="x") + [scale.Runner("odd", "odd", settings=())]
    runners.insert(3, scale.Runner("infinigen (measured share)", "infinigen", reason="no measured InfiniGen rows"))
    table = scale.projection(hardware_names=("h100_sxm",), kernels=False, loads=[LONG], runner_list=runners)
    lines = {line.split(":")[0][2:]: line for line in yours.workload_text(table).splitlines() if line.startswith("- ")}
    assert lines["odd"].startswith("- odd: not projected: kvlib.projection.policy_step reads no rule for odd's")
    assert lines["infinigen (measured share)"] == "- infinigen (measured share): not projected: no measured InfiniGen rows"
    assert "(bound)" in lines["full"]


def test_a_policy_keeping_30_percent_reads_and_holds_less_than_full(shape):
    full = step(shape, runner("full"))
    for kept in (runner("streaming", budget=0.3), runner("snapkv", budget=0.3),
                 runner("h2o", budget=0.3, budget_rule="flexgen")):
        work = step(shape, kept)
        # streaming keeps 0.3 of what a row has seen; snapkv 0.3 of the prompt and its new tokens; H2O (FlexGen's
        # rule) 2 x 0.3 of the prompt: each reads about that share of full's KV
        share = work["kv_read_bytes"] / full["kv_read_bytes"]
        assert share < 0.65 and work["weight_bytes"] == full["weight_bytes"], kept.policy
        assert memory(shape, kept)["device_kv_gb_projected"] < memory(shape, runner("full"))["device_kv_gb_projected"]
    streaming = step(shape, runner("streaming", budget=0.3))["kv_read_bytes"] / full["kv_read_bytes"]
    assert streaming == pytest.approx(0.3, abs=0.01)
    assert step(shape, runner("h2o", budget=0.3, budget_rule="flexgen"))["select_read_bytes"] > 0  # it scores
    assert step(shape, runner("streaming", budget=0.3))["select_read_bytes"] == 0
    # the generic rule gives the paper rule's H2O step where their settings agree
    assert step(shape, runner("h2o", budget=0.3, budget_rule="flexgen")) == step(shape, scale.Runner("h2o", "h2o"))


def test_quest_reads_its_budget_of_pages_but_holds_every_entry(shape):
    full, quest = step(shape, runner("full")), step(shape, runner("quest", budget=0.3, dense_layers=2))
    assert quest["kv_read_bytes"] < 0.4 * full["kv_read_bytes"] and quest["select_read_bytes"] > 0
    assert memory(shape, runner("quest"))["device_kv_gb_projected"] > memory(shape, runner("full"))["device_kv_gb_projected"]


def test_a_quantized_policy_reads_and_holds_fewer_bytes_a_token(shape):
    full, kivi = step(shape, runner("full")), step(shape, runner("kivi", bits=2, group_size=32, residual=128))
    assert kivi["attention_flops"] == full["attention_flops"]  # every token attended
    assert kivi["kv_read_bytes"] < 0.25 * full["kv_read_bytes"]  # 2-bit codes and their scales, a residual in bf16
    four = step(shape, runner("kivi", bits=4, group_size=32, residual=128))
    assert kivi["kv_read_bytes"] < four["kv_read_bytes"] < full["kv_read_bytes"]
    assert memory(shape, runner("kivi"))["device_kv_gb_projected"] < 0.25 * memory(shape, runner("full"))["device_kv_gb_projected"]


def test_a_host_tier_moves_its_share_over_the_link_each_step(shape):
    s = shape[1]
    full = step(shape, runner("full"))
    assert full["host_to_device_bytes"] == 0
    on_host = step(shape, runner("flexgen", percent="100 0 0 100 100 0"))
    held = LONG.mean_held
    assert on_host["host_to_device_bytes"] == pytest.approx(full["kv_read_bytes"] * (held - 1) / held)
    assert on_host["device_to_host_bytes"] == pytest.approx(LONG.batch * s.num_layers * s.num_kv_heads
                                                            * s.kv_token_bytes)  # the new token stored back
    half = step(shape, runner("flexgen", percent="100 0 50 50 100 0"))
    assert half["host_to_device_bytes"] == pytest.approx(on_host["host_to_device_bytes"] / 2, rel=0.01)
    assert memory(shape, runner("flexgen", percent="100 0 0 100 100 0"))["host_gb_projected"] == pytest.approx(
        LONG.batch * LONG.final_held * s.num_layers * s.num_kv_heads * s.kv_token_bytes / 1e9)
    # its H2O port streams only the kept set, with each entry's score and position
    port = step(shape, runner("flexgen_h2o", percent="100 0 0 100 100 0", budget=0.3))
    assert 0 < port["host_to_device_bytes"] < 0.7 * on_host["host_to_device_bytes"]
    table = scale.projection(hardware_names=("h100_sxm",), kernels=False, loads=[LONG],
                             runner_list=[runner("full"), runner("flexgen", percent="100 0 0 100 100 0")])
    assert table.transfer_ms_projected.iloc[1] > 0 and table.transfer_ms_projected.iloc[0] == 0


def test_the_users_limit_says_over_where_a_runner_needs_more_and_the_lines_fit_100_columns():
    from kvlib.commands.choose import WIDTH, _wrapped

    table = scale.projection(hardware_names=("h100_sxm",), kernels=False, loads=[LONG],
                             runner_list=yours.workload_runners("embedded", SYSTEMS))
    limit = 18.0  # the 8B model's weights are 16 GB: some runners' KV fits beside them, full's does not
    lines = {line.split(":")[0][2:]: line for line in yours.workload_text(table, limit).splitlines()
             if line.startswith("- ")}
    over = fits = 0
    for _, row in table.iterrows():
        if isinstance(row.get("not_projected"), str):
            continue
        said = "(over your 18 GB)" in lines[row.runner]
        assert said == (row.device_gb_projected > limit), row.runner
        over, fits = over + said, fits + (not said)
    assert over and fits
    assert all(len(line) <= WIDTH for line in _wrapped(yours.workload_text(table, limit)).splitlines())


def test_the_projected_answer_is_valid_json_where_a_row_lacks_a_figure():
    import json
    from dataclasses import asdict

    from kvlib.report.choose.projected import choose_projected

    answer = choose_projected("llama-3.1-8b", "h100_sxm", 8192, 4, 256, profile="embedded", device_limit_gb=18.0,
                              systems=SYSTEMS)
    json.dumps(asdict(answer), allow_nan=False)  # kivi has no aiconfigurator estimate: None, not NaN
    assert {r["policy"] for r in answer.rows} >= {p for _, p, _ in SYSTEMS}
