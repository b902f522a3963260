"""A profile's result rows as the pages that read across chapters take them (the findings' verdicts and overview
figure, the chooser, the systems table): one frame per experiment, empty where the profile did not run it. A page
names the rows it reads as an attribute, so a misspelt experiment fails where it is written (not as an empty frame),
and each experiment's rows are read the first time a page asks for them: a page reads, or computes, only what it
uses."""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd


class _Rows:
    """One experiment's rows, named by the attribute that holds them."""

    def __set_name__(self, owner, name: str):
        self.name = name

    def __get__(self, rows: StudyRows | None, owner=None):
        if rows is None:
            return self
        if self.name not in rows.read:
            rows.read[self.name] = rows.load(self.name)
        return rows.read[self.name]


class StudyRows:
    ttft = _Rows()
    batch_scaling = _Rows()
    decode_length = _Rows()
    offload = _Rows()
    serving = _Rows()
    accuracy = _Rows()
    retention = _Rows()

    def __init__(self, load: Callable[[str], pd.DataFrame] | None = None, **given: pd.DataFrame):
        """load(name): an experiment's rows (kvlib.study.results.load, kvlib.study.stored); given: rows at hand, by
        experiment (a test's); an experiment neither gives is empty."""
        unknown = set(given) - set(self.names())
        if unknown:
            raise TypeError(f"no experiment's rows are named {sorted(unknown)}; these are: {list(self.names())}")
        self.load = load or (lambda name: pd.DataFrame())
        self.read: dict[str, pd.DataFrame] = dict(given)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The experiments whose rows it holds, in the book's order."""
        return tuple(name for name, value in vars(cls).items() if isinstance(value, _Rows))
