"""The Markdown a notebook displays its sentences in. The sentences live by concern and are imported from there:
kvlib.report.timing_lines (TTFT, batch scaling, decode length, serving), kvlib.report.accuracy_lines (accuracy, RULER,
retention), kvlib.report.verdicts (the paper's five findings); each is computed from a results frame, and nothing
there states a number it did not read."""

from __future__ import annotations


def markdown(lines: list[str]) -> str:
    """The sentences as a bulleted list, for a notebook's Markdown display."""
    return "\n".join(f"- {line}" for line in lines)
