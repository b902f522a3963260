"""The book's sentences, one entry point: each experiment's detailed reading, the verdict table, and the Markdown a
notebook displays. Every sentence is computed from a results frame; nothing here states a number it did not
read. The readings live by concern: kvlib.report.timing_lines (TTFT, batch scaling, decode length, serving),
kvlib.report.accuracy_lines (accuracy, RULER, retention), kvlib.report.verdicts (the paper's five findings)."""

from __future__ import annotations

from kvlib.report.accuracy_lines import accuracy, retention, ruler  # noqa: F401 -- the book's readings, by name
from kvlib.report.timing_lines import batch_scaling, decode_length, describe, serving, ttft  # noqa: F401
from kvlib.report.verdicts import (  # noqa: F401
    CONFIRMED,
    FINDINGS,
    INCONCLUSIVE,
    NOT_RUN,
    NOT_TESTABLE,
    REFUTED,
    evidence_markdown,
    throughput_claims,
    verdict_markdown,
    verdict_table,
)


def markdown(lines: list[str]) -> str:
    """The sentences as a bulleted list, for a notebook's Markdown display."""
    return "\n".join(f"- {line}" for line in lines)
