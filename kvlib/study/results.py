"""The results store: results/<profile>/<experiment>/, one parquet file per unit of work (a point's repeat), named
`<point key>-r<repeat>.parquet`, and a manifest (`points.json`) naming the units of the profile's current grid.

The study runner writes; notebooks, findings and the chooser read. A file is written to a temporary name and renamed,
so an interrupted run leaves nothing half-written, and a unit already stored is never recomputed unless forced.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pandas as pd

from kvlib.paths import MANIFEST, repo_root


def commit() -> str | None:
    """The checkout's commit, short (None outside a git checkout): what rows and a published book say they came from."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo_root(), capture_output=True,
                              check=False, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def results_dir(profile: str, experiment: str) -> Path:
    return repo_root() / "results" / profile / experiment


def unit_path(profile: str, experiment: str, key: str, repeat: int) -> Path:
    return results_dir(profile, experiment) / f"{key}-r{repeat}.parquet"


def _write_atomic(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def write_unit(profile: str, experiment: str, key: str, repeat: int, frame: pd.DataFrame) -> None:
    _write_atomic(unit_path(profile, experiment, key, repeat), lambda tmp: frame.to_parquet(tmp, index=False))


def write_manifest(profile: str, experiment: str, keys: list[str], repeats: int) -> None:
    """The units the profile's grid asks for: what readers load, whatever else an older grid left in the folder."""
    text = json.dumps({"points": keys, "repeats": repeats}, indent=1)
    _write_atomic(results_dir(profile, experiment) / MANIFEST, lambda tmp: tmp.write_text(text))


def missing_units(profile: str, experiment: str) -> list[str] | None:
    """File names of the manifest's units not stored yet; None when the experiment has no manifest (never run)."""
    manifest = results_dir(profile, experiment) / MANIFEST
    if not manifest.exists():
        return None
    spec = json.loads(manifest.read_text())
    units = [unit_path(profile, experiment, key, r) for r in range(spec["repeats"]) for key in spec["points"]]
    return [u.name for u in units if not u.exists()]


def load(profile: str, experiment: str) -> pd.DataFrame:
    """The stored rows of the manifest's units (every stored file, where there is no manifest)."""
    folder = results_dir(profile, experiment)
    files = sorted(folder.glob("*.parquet"))
    manifest = folder / MANIFEST
    if manifest.exists():
        wanted = set(json.loads(manifest.read_text())["points"])
        files = [f for f in files if f.name.split("-r")[0] in wanted]
    frames = [pd.read_parquet(f) for f in files]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
