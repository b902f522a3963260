"""The engine: one Engine drives every policy through prefill and decode (its Session), the scheduler runs it as a
static batch or continuously, and every run ends in a RunResult with its metrics; capacity predicts where memory
runs out."""

from kvlib.engine.engine import Engine, RunSettings, Sequence

__all__ = ["Engine", "RunSettings", "Sequence"]
