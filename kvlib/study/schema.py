"""A params profile's schema: every key of a profile checked (its name, type and range) before anything loads or runs,
and every problem reported at once, each at its key path:

    params/bad.yaml: experiments.ttft.grid.prompt_tokens[0]: expected a positive integer, got 'abc'
    params/bad.yaml: experiments.ttft.fixed.chunk_sise: unknown key 'chunk_sise': neither a workload value of ttft
      ([...]) nor a policy setting

An experiment's grid, fixed and exploratory values are its workload's (checked here, by name) or a runner's setting
(`budget`, `budget_rule`, ...), which goes through the runner's own checks, as `kvlib run --set` does, for each policy
of the experiment that has it (kvlib.study.profile expands the grid the same way)."""

from __future__ import annotations

import dataclasses

from kvlib.models import WEIGHTS
from kvlib.study.checks import (
    is_int,
    is_number,
    non_negative_int,
    one_of,
    positive_int,
    positive_number,
    share,
    source,
    text,
)
from kvlib.study.experiments import REGISTRY, check_weights
from kvlib.study.overrides import toy_problems, with_toy
from kvlib.study.runners import make_runner, runner_class, runners

PREFILL = ("full", "fused", "chunked")
COMMON = {"text_source": source, "calibration_source": source, "chunk_size": positive_int, "prefill": one_of(*PREFILL),
          "seed": non_negative_int}
PROFILE_KEYS = {"model", "device_capacity_gb", "policy_settings", "experiments", "description", "device", "weights",
                "validity_gate", "toy"}
EXPERIMENT_KEYS = {"policies", "grid", "fixed", "model", "device_capacity_gb", "repeats", "exploratory", "arms"}
ARM_KEYS = {"policies", "grid", "fixed", "role", "model"}


class Problems(list):
    def add(self, path: str, problem: str | None) -> None:
        if problem:  # a nested check's problem may start with its own path: "[2]: ..." or "key: ..."
            self.append(f"{path}{problem}" if problem.startswith("[") else f"{path}: {problem}")


def check_profile(raw) -> list[str]:
    """Every problem of a profile's raw mapping, each `key.path: what is wrong` (empty: the profile is valid)."""
    problems = Problems()
    if not isinstance(raw, dict):
        problems.add("(profile)", f"expected a mapping of {sorted(PROFILE_KEYS)}, got {raw!r}")
        return problems
    for key in sorted(set(raw) - PROFILE_KEYS, key=str):
        problems.add(str(key), f"unknown key {key!r}; allowed: {sorted(PROFILE_KEYS)}")
    if "model" not in raw:
        problems.add("model", "`model` is required")
    for key, check in (("model", text), ("description", text), ("device", text),
                       ("device_capacity_gb", positive_number), ("validity_gate", share),
                       ("weights", one_of(*WEIGHTS))):
        if raw.get(key) is not None:
            problems.add(key, check(raw[key]))
    settings = raw.get("policy_settings") or {}
    if not isinstance(settings, dict):
        problems.add("policy_settings", f"expected a mapping of policy: settings, got {settings!r}")
        settings = {}
    for name, values in settings.items():
        if name not in runners():
            problems.add(f"policy_settings.{name}", f"unknown key {name!r}; allowed: {sorted(runners())}")
        elif not isinstance(values, dict):
            problems.add(f"policy_settings.{name}", f"expected a mapping of settings, got {values!r}")
        else:
            for key, value in values.items():
                problems.add(f"policy_settings.{name}.{key}", _setting_problem(name, {}, key, value))
    experiments = raw.get("experiments") or {}
    if not isinstance(experiments, dict):
        problems.add("experiments", f"expected a mapping of experiment: spec, got {experiments!r}")
        experiments = {}
    for exp, spec in experiments.items():
        _check_experiment(problems, exp, spec, settings, raw.get("weights", "pretrained"))
    if raw.get("toy") is not None:
        _check_toy(problems, raw)
    return problems


def _check_toy(problems: Problems, raw: dict) -> None:
    """A `toy:` mapping (kvlib.study.overrides): its shape, then the profile with it laid over, whose problems that
    the profile alone does not have are the toy's."""
    shape = toy_problems(raw)
    for path, problem in shape:
        problems.add(path, problem)
    if not shape:
        own = set(problems)
        for problem in check_profile(with_toy(raw)):
            if problem not in own:
                problems.add("toy", f"laid over the profile, {problem}")


def _check_experiment(problems: Problems, exp, spec, settings: dict, weights) -> None:
    here = f"experiments.{exp}"
    if exp not in REGISTRY:
        problems.add(here, f"unknown experiment {exp!r}; experiments: {list(REGISTRY)}")
        return
    if spec is None:
        spec = {}
    if not isinstance(spec, dict):
        problems.add(here, f"expected a mapping of {sorted(EXPERIMENT_KEYS)}, got {spec!r}")
        return
    try:
        check_weights(exp, weights)
    except Exception as exc:  # noqa: BLE001 (UserError: its message is the problem)
        problems.add(here, str(exc))
    for key in sorted(set(spec) - EXPERIMENT_KEYS, key=str):
        problems.add(here, f"unknown key {key!r}; allowed: {sorted(EXPERIMENT_KEYS)}")
    for key, check in (("model", text), ("device_capacity_gb", positive_number), ("repeats", positive_int)):
        if spec.get(key) is not None:
            problem = check(spec[key])
            if problem and key == "model":
                problem = f"must be a model name, {problem}"
            problems.add(f"{here}.{key}", problem)
    names = _policies(problems, f"{here}.policies", spec.get("policies", "all"))
    grid, fixed = spec.get("grid") or {}, spec.get("fixed") or {}
    exploratory = spec.get("exploratory") or {}
    if not isinstance(exploratory, dict):
        problems.add(f"{here}.exploratory", f"expected a mapping of policies and fixed, got {exploratory!r}")
        exploratory = {}
    for key in sorted(set(exploratory) - {"policies", "fixed"}, key=str):
        problems.add(f"{here}.exploratory", f"unknown key {key!r}; allowed: ['fixed', 'policies']")
    explored = _policies(problems, f"{here}.exploratory.policies", exploratory.get("policies", []))
    parts = [("grid", grid, True, names), ("fixed", fixed, False, names),
             ("exploratory.fixed", exploratory.get("fixed") or {}, False, explored)]
    for i, arm in enumerate(_arms(problems, f"{here}.arms", spec.get("arms") or [])):
        armed = _policies(problems, f"{here}.arms[{i}].policies", arm.get("policies", []))
        parts += [(f"arms[{i}].grid", arm.get("grid") or {}, True, armed),
                  (f"arms[{i}].fixed", arm.get("fixed") or {}, False, armed)]
    for part, values, as_axis, who in parts:
        if not isinstance(values, dict):
            problems.add(f"{here}.{part}", f"expected a mapping of values, got {values!r}")
            continue
        for key, value in values.items():
            path = f"{here}.{part}.{key}"
            if as_axis and (not isinstance(value, list) or not value):
                problems.add(path, f"a grid axis must be a non-empty list, got {value!r}")
                continue
            for i, v in enumerate(value) if as_axis else [(None, value)]:
                _check_value(problems, path if i is None else f"{path}[{i}]", exp, key, v, who)
    given = set(grid) | set(fixed) if isinstance(grid, dict) and isinstance(fixed, dict) else set()
    for key in REGISTRY[exp].required:
        either = key if isinstance(key, tuple) else (key,)  # one of them
        if not set(either) & given:
            problems.add(f"{here}", f"needs {' or '.join(map(repr, either))} in its grid or fixed values")


def _arms(problems: Problems, path: str, arms) -> list[dict]:
    """An experiment's arms, each a mapping of policies, grid, fixed values and a role."""
    if not isinstance(arms, list) or not all(isinstance(a, dict) for a in arms):
        problems.add(path, f"expected a list of mappings of {sorted(ARM_KEYS)}, got {arms!r}")
        return []
    for i, arm in enumerate(arms):
        for key in sorted(set(arm) - ARM_KEYS, key=str):
            problems.add(f"{path}[{i}]", f"unknown key {key!r}; allowed: {sorted(ARM_KEYS)}")
        if not arm.get("policies"):
            problems.add(f"{path}[{i}]", "needs its policies")
        if arm.get("role", "confirmatory") not in ("confirmatory", "exploratory"):
            problems.add(f"{path}[{i}].role", f"expected confirmatory or exploratory, got {arm['role']!r}")
    return arms


def _check_value(problems: Problems, path: str, exp: str, key, value, runner_names: list[str]) -> None:
    """A grid or fixed value: the workload's, or the setting of the runners of `runner_names` that have it."""
    having = [name for name in runner_names if key in setting_names(name)]
    any_setting = {k for name in runners() for k in setting_names(name)}
    if key in any_setting:
        found = {}
        for name in having:
            problem = _setting_problem(name, {}, key, value)  # (with the profile's settings: Profile.points)
            if problem:
                found.setdefault(problem, []).append(name)
        for problem, names in found.items():
            problems.add(path, f"{problem} ({', '.join(names)})")
        return
    allowed = {**COMMON, **REGISTRY[exp].workload}
    if key not in allowed:
        problems.add(path, f"unknown key {key!r}: neither a workload value of {exp} ({sorted(allowed)}) nor a policy "
                           f"setting")
        return
    problems.add(path, allowed[key](value))


def _policies(problems: Problems, path: str, names) -> list[str]:
    """The runners a policies list names (`all`: every kvlib policy)."""
    from kvlib.policies import available

    if names == "all":
        return available()
    if not isinstance(names, list):
        problems.add(path, f"must be `all` or a list of policy names, got {names!r}")
        return []
    unknown = [n for n in names if n != "all" and n not in runners()]
    for n in unknown:
        problems.add(path, f"unknown key {n!r}; allowed: {sorted(runners())}")
    return [p for n in names if n not in unknown for p in (available() if n == "all" else [n])]


def setting_names(runner: str) -> set[str]:
    return {f.name for f in dataclasses.fields(runner_class(runner))}


def _setting_problem(runner: str, base: dict, key, value) -> str | None:
    """A runner's setting `key` = value: its type from the runner's fields, then the runner's own checks (those of
    `kvlib run --set`)."""
    fields = {f.name: f for f in dataclasses.fields(runner_class(runner))}
    if key not in fields:
        return f"unknown key {key!r}; {runner}'s settings: {sorted(fields)}"
    expected = _types(fields[key].type)
    if expected is not None and not any(_instance(value, t) for t in expected):
        return f"expected {fields[key].type}, got {value!r}"
    try:
        make_runner(runner, **{**base, key: value})
    except Exception as exc:  # noqa: BLE001 (UserError, or a TypeError of a value the runner cannot compare)
        return str(exc)
    return None


TYPES = {"int": int, "float": float, "bool": bool, "str": str, "None": type(None), "dict": dict, "list": list}


def _types(annotation) -> list[type] | None:
    """The types an annotation (a string under `from __future__ import annotations`) names; None where it names
    another (the runner's own checks then decide)."""
    names = [t.strip() for t in str(annotation).split("|")]
    return [TYPES[n] for n in names] if all(n in TYPES for n in names) else None


def _instance(value, t: type) -> bool:
    if t is float:
        return is_number(value)
    if t is int:
        return is_int(value)
    return isinstance(value, t)
