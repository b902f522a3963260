"""A user's module, written to a file and imported as theirs would be; what it registers is undone afterwards (the
toy policy and the toy experiment are declared so)."""

import contextlib
import importlib.util
from pathlib import Path


@contextlib.contextmanager
def user_module(path: Path, code: str, registry: dict):
    """Write `code` to `path`, import it, and yield the names it added to `registry`; they are removed on exit."""
    path.write_text(code)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    before = set(registry)
    try:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        yield set(registry) - before
    finally:
        for name in set(registry) - before:
            del registry[name]
