"""A params profile (params/<name>.yaml, or a user's own YAML file) and the typed grid points it expands into.

    model: smollm2-135m              # default model of every experiment (an experiment's own `model:` overrides it)
    validity_gate: 0.7               # policies are compared on a task only where the full cache scores at least this
    weights: random                  # optional: seeded random weights (systems experiments only; kvlib.models)
    device_capacity_gb: 1.0          # configured device memory (OOM boundaries); null = unlimited
    policy_settings: {h2o: {budget: 0.3}}   # per-policy settings used wherever the policy runs
    experiments:
      ttft:
        policies: [all, vllm]        # `all`: every kvlib policy; `vllm`: the real vLLM (an extra)
        grid: {prompt_tokens: [512, 2048], prefill: [full, fused, chunked]}
        fixed: {chunk_size: 512}
      accuracy:
        model: qwen2.5-coder-0.5b    # this experiment's model
        device_capacity_gb: null     # and its device memory (the profile's is sized for the profile's model)
        policies: [full, h2o, infinigen]
        grid: {task: [kvlib_recall], budget: [0.1, 0.5]}   # a setting as an axis: full (no budget) runs once
        exploratory: {policies: [streaming], fixed: {limit: 50}}   # these policies on fewer items, labelled so
        repeats: 1                   # timing experiments: 3 or more (every repeat stored)

A grid or fixed value named after a runner's setting (`budget`, `budget_rule`) is that runner's setting, for the
runners that have it; every other value describes the workload. A point's settings are resolved once, here, to the
runner's complete settings (defaults included), so a result row says exactly what ran.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import yaml

from kvlib.errors import UserError
from kvlib.models import WEIGHTS
from kvlib.models.random_weights import check_experiment
from kvlib.report.gate import GATE
from kvlib.settings import capacity_bytes
from kvlib.study.runners import make_runner, runner_class, runners

EXPERIMENTS = ("ttft", "batch_scaling", "decode_length", "serving", "accuracy", "retention")
PROFILE_KEYS = {"model", "device_capacity_gb", "policy_settings", "experiments", "description", "device", "weights",
                "validity_gate"}
EXPERIMENT_KEYS = {"policies", "grid", "fixed", "model", "device_capacity_gb", "repeats", "exploratory"}


@dataclass(frozen=True)
class Point:
    """One grid point: which runner with which settings, on which workload. Its key names its results files."""

    experiment: str
    runner: str
    settings: dict  # the runner's complete settings
    values: dict  # the workload: grid and fixed values that are no runner setting
    model: str
    weights: str = "pretrained"
    device: str | None = None
    device_capacity_gb: float | None = None

    @cached_property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True, default=str).encode()).hexdigest()[:16]

    @property
    def capacity_bytes(self) -> int | None:
        return capacity_bytes(self.device_capacity_gb)

    def columns(self) -> dict:
        """The point as flat result columns: the runner (its label as `policy`), each setting and workload value in a
        column of its own (nested values as JSON), and the key."""
        cls = runner_class(self.runner)
        flat = {k: json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v
                for k, v in {**self.settings, **self.values}.items()}
        return {"experiment": self.experiment, "runner": self.runner, "policy": cls.label, "outside": cls.outside,
                "lossless": cls.lossless and not self.settings.get("compress_cache"),  # (flexgen's 4-bit cache)
                "model": self.model, "weights": self.weights, "device": self.device,
                "device_capacity_gb": self.device_capacity_gb, **flat, "point_hash": self.key}


@dataclass
class Profile:
    name: str
    model: str
    device_capacity_gb: float | None
    policy_settings: dict
    experiments: dict
    device: str | None = None
    weights: str = "pretrained"
    validity_gate: float = GATE  # the full cache's score a task needs before policies are compared on it

    def repeats(self, experiment: str) -> int:
        return self.experiments[experiment].get("repeats", 1)

    def points(self, experiment: str) -> list[Point]:
        """Every grid point of one experiment, in a stable order."""
        spec = self.experiments[experiment]
        grid, fixed = spec.get("grid", {}), spec.get("fixed", {})
        any_setting = {name for r in runners() for name in _setting_names(r)}
        points = []
        for name in self._runners(spec["policies"]):
            own = _setting_names(name)
            # an axis named after a setting (e.g. budget) varies only the runners that have it
            axes = sorted(a for a in grid if a in own or a not in any_setting)
            for values in itertools.product(*(grid[a] for a in axes)):
                given = {**fixed, **self._exploratory_values(spec, name), **dict(zip(axes, values))}
                settings = {**self.policy_settings.get(name, {}), **{k: v for k, v in given.items() if k in own}}
                workload = {k: v for k, v in given.items() if k not in any_setting}
                cls = runner_class(name)
                if workload.get("prefill", cls.preferred_prefill) not in cls.supported_prefill:
                    continue  # e.g. H2O cannot score under fused prefill: nothing to measure
                points.append(Point(experiment, name, make_runner(name, **settings).settings(), workload,
                                    spec.get("model", self.model), self.weights, self.device,
                                    spec.get("device_capacity_gb", self.device_capacity_gb)))
        return points

    @staticmethod
    def _exploratory_values(spec: dict, runner: str) -> dict:
        """An experiment whose `exploratory: {policies: [...], fixed: {...}}` names policies runs them with those
        fixed values over the experiment's (fewer items, say), and every point says which it is (`role`): the
        confirmatory points carry the verdicts, the exploratory ones are read as such."""
        exploratory = spec.get("exploratory")
        if not exploratory:
            return {}
        if runner in exploratory.get("policies", []):
            return {**exploratory.get("fixed", {}), "role": "exploratory"}
        return {"role": "confirmatory"}

    def _runners(self, names) -> list[str]:
        from kvlib.policies import available

        if names == "all":
            return available()
        return [p for name in names for p in (available() if name == "all" else [name])]


def _setting_names(runner: str) -> set[str]:
    from dataclasses import fields

    return {f.name for f in fields(runner_class(runner))}


def profile_path(name_or_path: str, root: Path) -> Path:
    """A profile by name (params/<name>.yaml under root) or a path to any YAML file."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.parent != Path("."):
        if not path.is_file():
            raise UserError(f"profile file {name_or_path!r} does not exist")
        return path
    path = root / "params" / f"{name_or_path}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in (root / "params").glob("*.yaml"))
        raise UserError(f"unknown profile {name_or_path!r}; profiles: {known}, or a path to a YAML file")
    return path


def load_profile(name_or_path: str, root: Path) -> Profile:
    """Results of a profile file go to results/<its file name without .yaml>/."""
    path = profile_path(name_or_path, root)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: not valid YAML ({exc})") from None
    return validate_profile(path.stem, raw, where=str(path))


def validate_profile(name: str, raw: dict, where: str | None = None) -> Profile:
    where = where or f"params/{name}.yaml"
    _no_unknown(raw, PROFILE_KEYS, where)
    if "model" not in raw:
        raise UserError(f"{where}: `model` is required")
    weights = raw.get("weights", "pretrained")
    if weights not in WEIGHTS:
        raise UserError(f"{where}: weights must be one of {list(WEIGHTS)}, got {weights!r}")
    settings = raw.get("policy_settings") or {}
    _no_unknown(settings, set(runners()), f"{where}: policy_settings")
    for runner, values in settings.items():
        _no_unknown(values, _setting_names(runner), f"{where}: policy_settings.{runner}")
        _checked(f"{where}: policy_settings.{runner}", make_runner, runner, **values)
    experiments = raw.get("experiments") or {}
    for exp, spec in experiments.items():
        here = f"{where}: experiments.{exp}"
        if exp not in EXPERIMENTS:
            raise UserError(f"{where}: unknown experiment {exp!r}; experiments: {list(EXPERIMENTS)}")
        _checked(where, check_experiment, exp, weights)
        _no_unknown(spec, EXPERIMENT_KEYS, here)
        spec["policies"] = policies = spec.get("policies", "all")
        if policies != "all":
            if not isinstance(policies, list):
                raise UserError(f"{here}.policies must be `all` or a list of policy names")
            _no_unknown({p: None for p in policies if p != "all"}, set(runners()), f"{here}.policies")
        for axis, values in (spec.get("grid") or {}).items():
            if not isinstance(values, list) or not values:
                raise UserError(f"{here}.grid.{axis} must be a non-empty list")
        exploratory = spec.get("exploratory") or {}
        _no_unknown(exploratory, {"policies", "fixed"}, f"{here}.exploratory")
        _no_unknown({p: None for p in exploratory.get("policies", [])}, set(runners()), f"{here}.exploratory.policies")
        repeats = spec.get("repeats", 1)
        if not isinstance(repeats, int) or repeats < 1:
            raise UserError(f"{here}.repeats must be an integer >= 1, got {repeats!r}")
    capacity = raw.get("device_capacity_gb")
    _checked(where, capacity_bytes, capacity)
    gate = raw.get("validity_gate", GATE)
    if isinstance(gate, bool) or not isinstance(gate, (int, float)) or not 0 < gate <= 1:
        raise UserError(f"{where}: validity_gate must be a share in (0, 1], got {gate!r}")
    for exp, spec in experiments.items():
        if "model" in spec and not isinstance(spec["model"], str):
            raise UserError(f"{where}: experiments.{exp}.model must be a model name, got {spec['model']!r}")
        _checked(f"{where}: experiments.{exp}", capacity_bytes, spec.get("device_capacity_gb"))
    profile = Profile(name, raw["model"], capacity, settings, experiments, raw.get("device"), weights, float(gate))
    for exp in experiments:  # bad settings on a grid axis (a budget of 2) fail here, before anything runs
        _checked(f"{where}: experiments.{exp}", profile.points, exp)
    return profile


def _checked(where: str, check, *args, **kwargs):
    try:
        return check(*args, **kwargs)
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None


def _no_unknown(mapping, allowed: set, where: str) -> None:
    if not isinstance(mapping, dict):
        raise UserError(f"{where}: expected a mapping, got {mapping!r}")
    unknown = sorted(set(mapping) - allowed)
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r}; allowed: {sorted(allowed)}")
