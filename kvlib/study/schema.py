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
from collections.abc import Callable

from kvlib.models import WEIGHTS
from kvlib.models.random_weights import check_experiment
from kvlib.settings import DECODED, PROTOCOLS
from kvlib.study.overrides import toy_problems, with_toy
from kvlib.study.runners import make_runner, runner_class, runners

Check = Callable[[object], str | None]  # a value's problem, or None
PREFILL = ("full", "fused", "chunked")


def described(words: str):
    """A check's type in words, for the profile guide (kvlib.study.profile_guide)."""
    def mark(check: Check) -> Check:
        check.kind = words
        return check
    return mark


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@described("a positive integer")
def positive_int(v):
    return None if _is_int(v) and v >= 1 else f"expected a positive integer, got {v!r}"


@described("an integer >= 0")
def non_negative_int(v):
    return None if _is_int(v) and v >= 0 else f"expected an integer >= 0, got {v!r}"


@described("a positive number")
def positive_number(v):
    return None if _is_number(v) and v > 0 else f"expected a positive number, got {v!r}"


@described("a share in (0, 1]")
def share(v):
    return None if _is_number(v) and 0 < v <= 1 else f"expected a share in (0, 1], got {v!r}"


@described("a name")
def text(v):
    return None if isinstance(v, str) and v else f"expected a name (a non-empty string), got {v!r}"


@described("a source mapping")
def source(v):
    """A text or conversation source: a mapping (kvlib.models.workloads)."""
    if not isinstance(v, dict):
        return f"expected a source mapping ({{kind: hf, path: ..., field: ...}}), got {v!r}"
    return None if isinstance(v.get("kind", "hf"), str) else f"expected a source whose kind is a name, got {v!r}"


def one_of(*choices) -> Check:
    return described(f"one of {', '.join(choices)}")(
        lambda v: None if isinstance(v, str) and v in choices else f"expected one of {list(choices)}, got {v!r}")


def optional(check: Check) -> Check:
    return described(f"{check.kind}, or null")(lambda v: None if v is None else check(v))


def list_of(check: Check) -> Check:
    def checked(v):
        if not isinstance(v, list) or not v:
            return f"expected a non-empty list, got {v!r}"
        bad = [(i, check(x)) for i, x in enumerate(v) if check(x)]
        return f"[{bad[0][0]}]: {bad[0][1]}" if bad else None
    return described(f"a list of {check.kind.removeprefix('a ').removeprefix('an ')}s")(checked)


def one_or_list(check: Check) -> Check:
    """A value, or a list of them that one point runs together (retention's protocols share a pass)."""
    return described(f"{check.kind}, or a list of them")(lambda v: list_of(check)(v) if isinstance(v, list) else check(v))


@described("[low, high] token counts")
def bucket(v):
    ok = isinstance(v, list) and len(v) == 2 and all(_is_int(x) and x >= 1 for x in v) and v[0] < v[1]
    return None if ok else f"expected a bucket [low, high] of token counts, low < high, got {v!r}"


@described("a depth in [0, 1]")
def depth(v):
    return None if _is_number(v) and 0 <= v <= 1 else f"expected a depth in [0, 1], got {v!r}"


def mapping_of(keys: dict[str, Check]) -> Check:
    def checked(v):
        if not isinstance(v, dict):
            return f"expected a mapping, got {v!r}"
        for key, value in v.items():
            if key not in keys:
                return f"{key}: unknown key; allowed: {sorted(keys)}"
            problem = keys[key](value)
            if problem:
                return f"{key}: {problem}"
        return None
    return described(f"a mapping of {', '.join(keys)}")(checked)


RULER = mapping_of({"max_seq_lengths": list_of(positive_int), "items": optional(positive_int),
                    "max_gen_toks": optional(positive_int)})
OFFLINE_TASKS = mapping_of({"recall_lengths": list_of(positive_int), "recall_items": positive_int,
                            "recall_choices": positive_int, "perplexity_docs_n": positive_int,
                            "perplexity_tokens": positive_int, "seed": non_negative_int,
                            "recall_depths": optional(list_of(depth))})
COMMON = {"text_source": source, "calibration_source": source, "chunk_size": positive_int, "prefill": one_of(*PREFILL),
          "seed": non_negative_int}
# each experiment's workload values (kvlib.study.experiments), with the ones it cannot run without
WORKLOAD: dict[str, dict[str, Check]] = {
    "ttft": {"prompt_tokens": positive_int, "max_new_tokens": positive_int},
    "batch_scaling": {"batch_size": positive_int, "min_prompt_tokens": positive_int, "max_prompt_tokens": positive_int,
                      "max_new_tokens": positive_int},
    "decode_length": {"output_tokens": positive_int, "prompt_tokens": positive_int, "batch_size": positive_int},
    "serving": {"num_requests": positive_int, "min_prompt_tokens": positive_int, "max_prompt_tokens": positive_int,
                "min_output_tokens": positive_int, "max_output_tokens": positive_int, "request_rate": positive_number,
                "rate_multiple": positive_number,
                "burstiness": positive_number, "slo_ttft_s": optional(positive_number),
                "slo_tpot_s": optional(positive_number)},
    "accuracy": {"task": text, "batch_size": positive_int, "protocol": one_of(*PROTOCOLS),
                 "limit": optional(positive_int), "ruler": optional(RULER), "offline_tasks": optional(OFFLINE_TASKS),
                 "prefill_store_gb": optional(positive_number)},
    "offload": {"batch_size": positive_int, "prompt_tokens": positive_int, "max_new_tokens": positive_int},
    "retention": {"query_turns": list_of(positive_int), "buckets": list_of(bucket), "per_bucket": positive_int,
                  "conversations": optional(source), "lockstep": positive_int, "answer_tokens": optional(positive_int),
                  "protocol": one_or_list(one_of(*DECODED))},
}
REQUIRED = {"ttft": ("prompt_tokens",), "batch_scaling": ("batch_size", "min_prompt_tokens", "max_prompt_tokens",
                                                          "max_new_tokens"),
            "decode_length": ("output_tokens", "prompt_tokens"),
            "serving": ("num_requests", "min_prompt_tokens", "max_prompt_tokens", "min_output_tokens",
                        "max_output_tokens", ("request_rate", "rate_multiple")),
            "accuracy": ("task",), "retention": ("query_turns", "buckets", "per_bucket"),
            "offload": ("batch_size", "prompt_tokens", "max_new_tokens")}
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
    if exp not in WORKLOAD:
        problems.add(here, f"unknown experiment {exp!r}; experiments: {list(WORKLOAD)}")
        return
    if spec is None:
        spec = {}
    if not isinstance(spec, dict):
        problems.add(here, f"expected a mapping of {sorted(EXPERIMENT_KEYS)}, got {spec!r}")
        return
    try:
        check_experiment(exp, weights)
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
    for key in REQUIRED[exp]:
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
    allowed = {**COMMON, **WORKLOAD[exp]}
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
        return _is_number(value)
    if t is int:
        return _is_int(value)
    return isinstance(value, t)
