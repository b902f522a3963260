"""`kvlib choose --hardware NAME --model NAME`: a workload projected where no measurement exists, said so."""

from kvlib.cli import main
from kvlib.report.choose import choose_projected


def test_a_projected_choice_names_each_runner_its_bound_and_its_memory():
    answer = choose_projected("llama-3.1-8b", "gh200", 2048, 8, 128, profile="smoke")
    assert {r["runner"] for r in answer.rows} >= {"full", "paged", "h2o", "infinigen (0.3 cap)"}
    text = answer.text()
    assert text.startswith("Projected on gh200") and "no measurement exists there" in text
    assert text.count("(bound)") == len(answer.rows) and "(projected)" in text
    assert all(r["decode_tokens_per_s_bound_projected"] > 0 for r in answer.rows)


def test_the_command_refuses_hardware_without_a_workload(capsys):
    assert main(["choose", "--profile", "smoke", "--request-rate", "1", "--hardware", "h100_sxm"]) != 0
    assert "--hardware projects a workload" in capsys.readouterr().err
