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
    toy: {model: smollm2-135m}       # optional: what `--toy` lays over the profile (kvlib.study.overrides)

A grid or fixed value named after a runner's setting (`budget`, `budget_rule`) is that runner's setting, for the
runners that have it; every other value describes the workload. A point's settings are resolved once, here, to the
runner's complete settings (defaults included), so a result row says exactly what ran.

A profile is checked whole against its schema (kvlib.study.schema) before anything loads, runs or is written: one
error lists every problem, each at its key path (`experiments.ttft.grid.prompt_tokens[0]: expected a positive
integer, got 'abc'`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvlib.errors import UserError
from kvlib.report.gate import GATE
from kvlib.study.experiments import names
from kvlib.study.overrides import overridden
from kvlib.study.point import Point
from kvlib.study.runners import make_runner, runner_class, runners
from kvlib.study.schema import EXPERIMENT_KEYS, PROFILE_KEYS, check_profile

__all__ = ["EXPERIMENT_KEYS", "PROFILE_KEYS", "Profile", "load_profile", "profile_path",
           "validate_profile"]


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

    def systems_runners(self) -> list[tuple[str, str, dict]]:
        """(label, runner, settings) of every runner the systems experiments run, each once (its first point's
        settings), in the experiments' order: what `kvlib choose --hardware` projects."""
        out: dict[str, tuple[str, str, dict]] = {}
        for experiment in names(systems=True):
            for point in self.points(experiment) if experiment in self.experiments else []:
                out.setdefault(point.runner, (runner_class(point.runner).label, point.runner, dict(point.settings)))
        return list(out.values())

    def repeats(self, experiment: str) -> int:
        return self.experiments[experiment].get("repeats", 1)

    def points(self, experiment: str) -> list[Point]:
        """Every grid point of one experiment, in a stable order: its grid's, then each of its arms' (an arm: other
        policies over another grid, its fixed values laid over the experiment's, on its own model if it names one)."""
        spec = self.experiments[experiment]
        points = self._grid_points(experiment, spec, spec["policies"], spec.get("grid", {}), spec.get("fixed", {}))
        for arm in spec.get("arms") or []:
            fixed = {**spec.get("fixed", {}), **arm.get("fixed", {}), "role": arm.get("role", "confirmatory")}
            own = {**spec, "model": arm.get("model", spec.get("model", self.model))}
            points += self._grid_points(experiment, own, arm["policies"], arm.get("grid", {}), fixed, arm=True)
        return points

    def _grid_points(self, experiment: str, spec: dict, policies, grid: dict, fixed: dict,
                     arm: bool = False) -> list[Point]:
        any_setting = {name for r in runners() for name in _setting_names(r)}
        points = []
        for name in self._runners(policies):
            own = _setting_names(name)
            # an axis named after a setting (e.g. budget) varies only the runners that have it
            axes = sorted(a for a in grid if a in own or a not in any_setting)
            for values in itertools.product(*(grid[a] for a in axes)):
                given = {**fixed, **({} if arm else self._exploratory_values(spec, name)), **dict(zip(axes, values))}
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


def load_profile(name_or_path: str, root: Path, device: str | None = None, toy: bool = False) -> Profile:
    """Results of a profile file go to results/<its file name without .yaml>/; run on another device or at its toy
    size (kvlib.study.overrides), to a folder of their own."""
    path = profile_path(name_or_path, root)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: not valid YAML ({exc})") from None
    profile = validate_profile(path.stem, raw, where=str(path))
    if device is None and not toy:
        return profile
    name, changed = overridden(path.stem, raw, device, toy)
    flags = " ".join([*(["--toy"] if toy else []), *([f"--device {device}"] if device else [])])
    return validate_profile(name, changed, where=f"{path} with {flags}")


def validate_profile(name: str, raw: dict, where: str | None = None) -> Profile:
    """The profile, once every key of it passed its schema (kvlib.study.schema): one UserError listing every problem
    otherwise, before anything loads, runs or is written."""
    where = where or f"params/{name}.yaml"
    problems = check_profile(raw)
    if problems:
        raise UserError("\n".join(f"{where}: {problem}" for problem in problems))  # one line a problem
    experiments = raw.get("experiments") or {}
    for spec in experiments.values():
        spec["policies"] = spec.get("policies", "all")
    profile = Profile(name, raw["model"], raw.get("device_capacity_gb"), raw.get("policy_settings") or {},
                      experiments, raw.get("device"), raw.get("weights", "pretrained"),
                      float(raw.get("validity_gate", GATE)))
    for exp in experiments:  # what the schema cannot see alone (a setting with the profile's other settings) fails
        _checked(f"{where}: experiments.{exp}", profile.points, exp)  # here, before anything runs
    return profile


def _checked(where: str, check, *args, **kwargs):
    try:
        return check(*args, **kwargs)
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None
