"""Where kvlib keeps things: the cache of converted models and per-model artifacts, and the checkout whose params/
and results/ the study uses."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models and per-model artifacts live (KVLIB_CACHE overrides)."""
    return Path(os.environ.get("KVLIB_CACHE", Path.home() / ".cache" / "kvlib"))


def repo_root() -> Path:
    """The checkout the package lives in (results/ and params/ sit there); KVLIB_ROOT overrides."""
    if "KVLIB_ROOT" in os.environ:
        return Path(os.environ["KVLIB_ROOT"])
    return Path(__file__).resolve().parents[1]


MANIFEST = "points.json"  # an experiment's manifest in results/<profile>/<experiment>/ (kvlib.study.results)


def machine_limits(profile: str) -> Path:
    """The limits of the machine that timed a profile's rows (kvlib.study.limits), stored beside them."""
    return repo_root() / "results" / profile / "machine.json"


def read_from(profile: str) -> Path:
    """Where a profile's rows are read: results/<profile>/, or its reference book (kvlib.study.reference) where that
    is published and the profile was never run on this checkout (no experiment's manifest), so that a profile's rows
    never mix this machine's with the reference's."""
    here = repo_root() / "results" / profile
    published = repo_root() / "reference" / profile
    return published if (published / "reference.json").exists() and not any(here.glob(f"*/{MANIFEST}")) else here
