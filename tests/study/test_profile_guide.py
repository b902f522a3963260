"""The profile guide is generated from what the code accepts: every key the schema checks has a meaning, every
runner's setting one, and the book's page is what the code gives (it fails if either went stale)."""

from kvlib.paths import repo_root
from kvlib.study import profile_guide, schema
from kvlib.study.experiments import REGISTRY


def test_every_key_the_schema_checks_has_a_meaning_and_a_type():
    assert set(profile_guide.PROFILE) == schema.PROFILE_KEYS
    assert set(profile_guide.EXPERIMENT) == schema.EXPERIMENT_KEYS
    for name, experiment in REGISTRY.items():
        for key, check in {**schema.COMMON, **experiment.workload}.items():
            assert key in {**profile_guide.WORKLOAD, **experiment.meanings}, \
                f"{name}.{key} has no meaning in kvlib.study.profile_guide or the experiment's declaration"
            assert check.kind, key  # (kvlib.study.checks.described)


def test_every_runners_setting_has_a_meaning():
    text = profile_guide.markdown()
    blank = [line for line in text.splitlines() if line.startswith("| `") and line.rstrip().endswith("|  |")]
    assert not blank, "settings without a comment beside their field or a line in profile_guide.SETTINGS:\n" + \
        "\n".join(blank)


def test_a_default_is_what_the_experiment_reads_and_a_required_key_says_so():
    text = profile_guide.workload_table("ttft")
    assert "| `prompt_tokens` | a positive integer | required |" in text
    assert "| `max_new_tokens` | a positive integer | `1` |" in text  # ttft reads v.get("max_new_tokens", 1)
    assert "| `prefill` | one of full, fused, chunked |" in text


def test_the_books_page_is_what_the_code_gives():
    assert (repo_root() / "book" / "profiles.md").read_text() == profile_guide.markdown() + "\n"
    assert "- file: profiles" in (repo_root() / "book" / "_toc.yml").read_text()


def test_the_guides_validity_gate_is_the_codes():
    """The guide's default gate is the one a profile without `validity_gate` gets (it once said 0.5 where the code's
    was 0.70)."""
    import dataclasses
    import re

    from kvlib.study.profile import Profile

    row = next(line for line in profile_guide.markdown().splitlines() if line.startswith("| `validity_gate` |"))
    stated = float(re.search(r"default ([0-9.]+)", row).group(1))
    default = next(f.default for f in dataclasses.fields(Profile) if f.name == "validity_gate")
    assert stated == default, row


def test_a_settings_comment_continued_on_the_next_line_is_read_whole():
    from kvlib.study.profile_guide import _comments
    from kvlib.study.runners import runner_class

    assert _comments(runner_class("duo"))["window"].endswith("(plus the new one during a step)")
