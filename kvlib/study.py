"""The study runner: params profiles -> grid points -> tidy results -> executed notebooks -> the book.

params/<profile>.yaml:
    model: smollm2-135m              # default model of every experiment
    weights: random                  # optional: seeded random weights (systems experiments only; kvlib.models)
    device_capacity_gb: 1.0          # configured device memory (OOM boundaries); null = unlimited
    policy_settings: {h2o: {budget: 0.3}}   # per-policy settings used wherever the policy runs
    experiments:
      ttft:
        policies: [all, vllm]        # `all`: every kvlib policy; `vllm`: the real vLLM (an extra)
        grid: {prompt_tokens: [512, 2048], prefill: [full, fused, chunked]}
        fixed: {chunk_size: 512}
      accuracy:
        policies: [full, h2o, infinigen]
        grid: {task: [kvlib_recall], budget: [0.1, 0.5]}   # a setting as an axis: full (no budget) runs once
        repeats: 1                   # timing experiments: 3 or more (every repeat stored)

A grid point is a flat dict (experiment, model, policy, its settings, the grid values, the fixed values); its hash and
the repeat name its results file `results/<profile>/<experiment>/<hash>-r<repeat>.parquet`. Repeats run interleaved:
every point once, then every point again, so a slow minute of the machine does not land on one policy's repeats. Each
unit of work records the machine's load while it ran (kvlib.machine_load); one measured while other processes took
the CPU is measured once more, and flagged `disturbed` if it still was. A stored unit is never recomputed unless
forced; files are written to a temporary name and renamed, so an interrupted run leaves nothing half-written.
Each experiment is a module `kvlib.experiments.<name>` with `run_point(point) -> list[dict]` (tidy rows).
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
import yaml
from tqdm import tqdm

import kvlib
from kvlib.errors import UserError
from kvlib.machine_load import measured_load

EXPERIMENTS = ("ttft", "batch_scaling", "decode_length", "accuracy", "retention")
PROFILE_KEYS = {"model", "device_capacity_gb", "policy_settings", "experiments", "description", "device", "weights"}
EXPERIMENT_KEYS = {"policies", "grid", "fixed", "model", "repeats"}
ATTEMPTS = 2  # a unit measured while other processes took the CPU is measured once more


def repo_root() -> Path:
    """The checkout the package lives in (results/ and params/ sit there); KVLIB_ROOT overrides."""
    if "KVLIB_ROOT" in os.environ:
        return Path(os.environ["KVLIB_ROOT"])
    return Path(kvlib.__file__).resolve().parents[1]


@dataclass
class Profile:
    name: str
    model: str
    device_capacity_gb: float | None
    policy_settings: dict
    experiments: dict
    device: str | None = None
    weights: str = "pretrained"

    def points(self, experiment: str) -> list[dict]:
        """Every grid point of one experiment, in a stable order."""
        from kvlib.backends import runner_class, runner_settings, runners

        spec = self.experiments[experiment]
        grid = spec.get("grid", {})
        any_setting = {name for p in runners() for name in runner_settings(p)}
        points = []
        for policy in self._policies(spec["policies"]):
            settings = dict(self.policy_settings.get(policy, {}))
            own = set(runner_settings(policy))
            # an axis named after a policy setting (e.g. budget) varies only the policies that have it
            axes = sorted(a for a in grid if a in own or a not in any_setting)
            for values in itertools.product(*(grid[a] for a in axes)):
                point = {"experiment": experiment, "model": spec.get("model", self.model), "policy": policy,
                         "policy_settings": settings, "device": self.device,
                         "device_capacity_gb": self.device_capacity_gb,
                         **spec.get("fixed", {}), **dict(zip(axes, values))}
                if self.weights != "pretrained":  # only then: points of other profiles keep their hashes
                    point["weights"] = self.weights
                prefill = point.get("prefill")
                cls = runner_class(policy)
                if prefill and cls is not None and prefill not in cls.supported_prefill:
                    continue  # e.g. H2O cannot score under fused prefill: nothing to measure
                points.append(point)
        return points

    def _policies(self, names) -> list[str]:
        from kvlib.policies import available

        if names == "all":
            return available()
        return [p for name in names for p in (available() if name == "all" else [name])]


def point_hash(point: dict) -> str:
    return hashlib.sha256(json.dumps(point, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_profile(name: str) -> Profile:
    path = repo_root() / "params" / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in (repo_root() / "params").glob("*.yaml"))
        raise UserError(f"unknown profile {name!r}; profiles: {known}")
    return validate_profile(name, yaml.safe_load(path.read_text()) or {})


def validate_profile(name: str, raw: dict) -> Profile:
    from kvlib.backends import runner_class, runner_settings, runners
    from kvlib.models import WEIGHTS
    from kvlib.random_weights import check_experiment

    where = f"params/{name}.yaml"
    _no_unknown(raw, PROFILE_KEYS, where)
    if "model" not in raw:
        raise UserError(f"{where}: `model` is required")
    weights = raw.get("weights", "pretrained")
    if weights not in WEIGHTS:
        raise UserError(f"{where}: weights must be one of {list(WEIGHTS)}, got {weights!r}")
    settings = raw.get("policy_settings") or {}
    for policy, values in settings.items():
        if runner_class(policy) is None:
            raise UserError(f"{where}: policy_settings names unknown policy {policy!r}; available: {runners()}")
        _no_unknown(values, set(runner_settings(policy)), f"{where}: policy_settings.{policy}")
    experiments = raw.get("experiments") or {}
    for exp, spec in experiments.items():
        if exp not in EXPERIMENTS:
            raise UserError(f"{where}: unknown experiment {exp!r}; experiments: {list(EXPERIMENTS)}")
        try:
            check_experiment(exp, weights)
        except UserError as exc:
            raise UserError(f"{where}: {exc}") from None
        _no_unknown(spec, EXPERIMENT_KEYS, f"{where}: experiments.{exp}")
        policies = spec.get("policies", "all")
        spec["policies"] = policies
        if policies != "all":
            if not isinstance(policies, list):
                raise UserError(f"{where}: experiments.{exp}.policies must be `all` or a list of policy names")
            for p in policies:
                if p != "all" and runner_class(p) is None:
                    raise UserError(f"{where}: experiments.{exp} names unknown policy {p!r}; available: {runners()}")
        for axis, values in (spec.get("grid") or {}).items():
            if not isinstance(values, list) or not values:
                raise UserError(f"{where}: experiments.{exp}.grid.{axis} must be a non-empty list")
        repeats = spec.get("repeats", 1)
        if not isinstance(repeats, int) or repeats < 1:
            raise UserError(f"{where}: experiments.{exp}.repeats must be an integer >= 1, got {repeats!r}")
    capacity = raw.get("device_capacity_gb")
    if capacity is not None and not (isinstance(capacity, (int, float)) and capacity > 0):
        raise UserError(f"{where}: device_capacity_gb must be a positive number or null, got {capacity!r}")
    return Profile(name, raw["model"], capacity, settings, experiments, raw.get("device"), weights)


def _no_unknown(mapping, allowed: set, where: str) -> None:
    if not isinstance(mapping, dict):
        raise UserError(f"{where}: expected a mapping, got {mapping!r}")
    unknown = sorted(set(mapping) - allowed)
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r}; allowed: {sorted(allowed)}")


def results_dir(profile: str, experiment: str) -> Path:
    return repo_root() / "results" / profile / experiment


def run_metadata(profile: str) -> dict:
    import torch
    import transformers

    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo_root(), capture_output=True, check=False,
                             text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        sha = None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"profile": profile, "kvlib_version": kvlib.__version__, "torch_version": torch.__version__,
            "transformers_version": transformers.__version__, "git_sha": sha, "device_name": device,
            "cpu_threads": torch.get_num_threads(), "finished_at": datetime.now(UTC).isoformat()}


def run_experiment(profile: str | Profile, experiment: str, force: bool = False, progress: bool = True,
                   policies: list[str] | None = None) -> pd.DataFrame:
    """Compute every missing grid point of one experiment (of the given policies only, if any), then return all of
    its stored rows."""
    prof = profile if isinstance(profile, Profile) else load_profile(profile)
    if experiment not in prof.experiments:
        raise UserError(f"profile {prof.name!r} has no experiment {experiment!r}; it has {sorted(prof.experiments)}")
    module = importlib.import_module(f"kvlib.experiments.{experiment}")
    out_dir = results_dir(prof.name, experiment)
    out_dir.mkdir(parents=True, exist_ok=True)
    points = prof.points(experiment)
    if policies is not None:
        from kvlib.backends import runners

        unknown = sorted(set(policies) - set(runners()))
        if unknown:
            raise UserError(f"unknown policies {unknown}: choose from {runners()}")
        points = [p for p in points if p["policy"] in policies]
    repeats = prof.experiments[experiment].get("repeats", 1)
    units = [(p, r) for r in range(repeats) for p in points]  # interleaved: every point once, then again
    todo = [(p, r) for p, r in units if force or not _unit_file(out_dir, point_hash(p), r).exists()]
    meta = run_metadata(prof.name)
    bar = tqdm(total=len(units), initial=len(units) - len(todo), desc=f"{prof.name}/{experiment}",
               unit="run", disable=not progress)
    for point, repeat in todo:
        for attempt in range(1, ATTEMPTS + 1):
            with measured_load() as load:
                rows = module.run_point(point)
            if not load.disturbed:
                break
        key = point_hash(point)
        frame = pd.DataFrame([{**_flat_point(point), **row, **meta, "point_hash": key, "repeat": repeat,
                               "attempts": attempt, **load.columns()} for row in rows])
        path = _unit_file(out_dir, key, repeat)
        tmp = path.with_name(f".{path.name}.tmp")
        frame.to_parquet(tmp, index=False)
        os.replace(tmp, path)
        bar.update(1)
    bar.close()
    return load_results(prof.name, experiment, [point_hash(p) for p in points])


def _unit_file(out_dir: Path, key: str, repeat: int) -> Path:
    return out_dir / f"{key}-r{repeat}.parquet"


def load_results(profile: str, experiment: str, hashes: list[str] | None = None) -> pd.DataFrame:
    """Stored rows of an experiment (only the given points, when hashes are given)."""
    out_dir = results_dir(profile, experiment)
    files = sorted(out_dir.glob("*.parquet"))
    if hashes is not None:
        wanted = set(hashes)
        files = [f for f in files if f.name.split("-r")[0] in wanted]
    frames = [pd.read_parquet(f) for f in files]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _flat_point(point: dict) -> dict:
    # nested values (policy settings, a text source) become JSON strings: parquet columns stay flat
    return {k: json.dumps(v, sort_keys=True) if isinstance(v, dict) else v for k, v in point.items()}


# -- the whole study: execute the notebooks and build the book ---------------------------------------------------
def run_study(profile: str, experiments: list[str] | None = None, force: bool = False, build: bool = False,
              policies: list[str] | None = None, notebooks: bool = True) -> None:
    prof = load_profile(profile)
    names = experiments or [e for e in EXPERIMENTS if e in prof.experiments]
    for name in names:
        # computed here, with a progress bar on the terminal; the notebook then finds every point stored
        run_experiment(prof, name, force=force, policies=policies)
        if notebooks:
            _execute(name, profile)
    if notebooks:
        _execute("findings", profile)
    if build:
        subprocess.run(["jupyter-book", "build", str(repo_root() / "book")], check=True,
                       env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})


def _execute(notebook: str, profile: str) -> None:
    import papermill

    root = repo_root()
    executed = root / "book" / "executed"
    executed.mkdir(parents=True, exist_ok=True)
    papermill.execute_notebook(str(root / "notebooks" / f"{notebook}.ipynb"), str(executed / f"{notebook}.ipynb"),
                               parameters={"profile": profile}, cwd=str(root / "notebooks"), progress_bar=False)
