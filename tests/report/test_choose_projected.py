"""`kvlib choose --hardware NAME --model NAME`: a workload projected where no measurement exists, said so."""

from kvlib.cli import main
from kvlib.report.choose.projected import choose_projected


def test_a_projected_choice_names_each_runner_its_bound_and_its_memory():
    answer = choose_projected("llama-3.1-8b", "gh200", 2048, 8, 128, profile="smoke")
    assert {r["runner"] for r in answer.rows} >= {"full", "paged", "h2o", "infinigen (0.3 cap)"}
    text = answer.text()
    assert text.startswith("Projected on gh200") and "no measurement exists there" in text
    # a runner without a projection (InfiniGen's measured share, before smoke's rows exist) says why instead
    bounded = [r for r in answer.rows if r.get("not_projected") is None]
    assert text.count("(bound)") == len(bounded) and "(projected)" in text
    assert text.count("not projected") == len(answer.rows) - len(bounded)
    assert all(r["decode_tokens_per_s_bound_projected"] > 0 for r in bounded)


def test_the_command_refuses_hardware_without_a_workload(capsys):
    assert main(["choose", "--profile", "smoke", "--request-rate", "1", "--hardware", "h100_sxm"]) != 0
    assert "--hardware projects a workload" in capsys.readouterr().err


def test_the_users_memory_limit_and_the_measured_accuracy_rulings_stand_beside_each_projection():
    from kvlib.report.choose.workload import Choice

    measured = Choice(None, None)
    measured.excluded["h2o"] = "loses more than allowed"
    measured.undecided["infinigen"] = "cannot tell"
    answer = choose_projected("llama-3.1-8b", "gh200", 2048, 8, 128, profile="smoke", device_limit_gb=1.0,
                              measured=measured)
    lines = {line.split(":")[0][2:]: line for line in answer.text().splitlines() if line.startswith("- ")}
    projected = [line for line in lines.values() if "not projected" not in line]
    assert projected and all("(over your 1 GB)" in line for line in projected)  # 8B weights: > 1 GB
    assert "accuracy: ruled out" in lines["h2o"] and "accuracy: cannot tell" in lines["infinigen (0.3 cap)"]
    assert "accuracy:" not in lines["paged"]

