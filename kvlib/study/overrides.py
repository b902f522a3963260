"""A profile run at another place or size than its file says: `kvlib study --device D` (the profile's `device`
replaced) and `--toy` (the profile's own `toy:` values laid over it: the same experiments and policies, so the same
code paths, at a size a CPU runs in seconds).

    toy:                             # in the profile: what --toy replaces
      model: smollm2-135m            # the profile's model, and device_capacity_gb
      policy_settings: {infinigen: {calibration_tokens: 64}}   # merged into each policy's settings
      experiments:
        batch_scaling:               # an experiment of the profile: its grid and fixed values merged key by key,
          grid: {batch_size: [2]}    # its repeats, model and device_capacity_gb replaced
          repeats: 1

Rows of an overridden run are measured on another machine or at another size than the profile's, so they never share
its results folder: they go to results/<profile>-toy/, results/<profile>-<device>/ or results/<profile>-toy-<device>/.
"""

from __future__ import annotations

import copy

from kvlib.errors import UserError

TOY_KEYS = ("model", "device_capacity_gb", "policy_settings", "experiments")
TOY_EXPERIMENT_KEYS = ("grid", "fixed", "repeats", "model", "device_capacity_gb")


def with_toy(raw: dict) -> dict:
    """The profile's raw mapping with its `toy:` values laid over it (and no `toy:` key left)."""
    toy = raw.get("toy") or {}
    out = copy.deepcopy({k: v for k, v in raw.items() if k != "toy"})
    for key in ("model", "device_capacity_gb"):
        if key in toy:
            out[key] = toy[key]
    if toy.get("policy_settings"):
        settings = out["policy_settings"] = dict(out.get("policy_settings") or {})
        for name, values in toy["policy_settings"].items():
            settings[name] = {**(settings.get(name) or {}), **values}
    for exp, spec in (toy.get("experiments") or {}).items():  # (each an experiment of the profile: toy_problems)
        base = out["experiments"][exp] = out["experiments"][exp] or {}
        for part in ("grid", "fixed"):
            if part in spec:
                base[part] = {**(base.get(part) or {}), **spec[part]}
        base.update({k: spec[k] for k in ("repeats", "model", "device_capacity_gb") if k in spec})
    return out


def toy_problems(raw: dict) -> list[tuple[str, str]]:
    """(key path, problem) of a `toy:` mapping's shape; its values are checked with the profile they are laid over."""
    toy = raw.get("toy")
    if not isinstance(toy, dict):
        return [("toy", f"expected a mapping of {list(TOY_KEYS)}, got {toy!r}")]
    found = [("toy", f"unknown key {k!r}; allowed: {list(TOY_KEYS)}") for k in toy if k not in TOY_KEYS]
    settings = toy.get("policy_settings") or {}
    if not isinstance(settings, dict) or not all(isinstance(v, dict) for v in settings.values()):
        found.append(("toy.policy_settings", "expected a mapping of policy: settings"))
    experiments = toy.get("experiments") or {}
    if not isinstance(experiments, dict):
        return [*found, ("toy.experiments", f"expected a mapping of experiment: values, got {experiments!r}")]
    own = raw.get("experiments") if isinstance(raw.get("experiments"), dict) else {}
    for exp, spec in experiments.items():
        here = f"toy.experiments.{exp}"
        if exp not in own:
            found.append((here, f"not an experiment of the profile ({sorted(own)}): a toy resizes, it adds nothing"))
        elif not isinstance(own[exp] or {}, dict):
            found.append((here, f"cannot be laid over experiments.{exp}, which is not a mapping"))
        elif not isinstance(spec, dict):
            found.append((here, f"expected a mapping of {list(TOY_EXPERIMENT_KEYS)}, got {spec!r}"))
        else:
            found += [(here, f"unknown key {k!r}; allowed: {list(TOY_EXPERIMENT_KEYS)}")
                      for k in spec if k not in TOY_EXPERIMENT_KEYS]
            found += [(f"{here}.{part}", f"expected a mapping of values, got {spec[part]!r}")
                      for part in ("grid", "fixed") if part in spec and not isinstance(spec[part], dict)]
    return found


def overridden(name: str, raw: dict, device: str | None = None, toy: bool = False) -> tuple[str, dict]:
    """(results name, raw mapping) of the profile run with `--device device` and `--toy`."""
    if toy and not raw.get("toy"):
        raise UserError(f"profile {name!r} has no toy size: --toy needs a `toy:` mapping in it (kvlib.study.overrides)")
    if device is not None:
        _check_device(device)
    out = with_toy(raw) if toy else copy.deepcopy(raw)
    parts = [name]
    if toy:
        parts.append("toy")
    if device is not None and device != raw.get("device"):
        out["device"] = device
        parts.append(device.replace(":", ""))
    return "-".join(parts), out


def _check_device(device: str) -> None:
    import torch

    try:
        torch.device(device)
    except RuntimeError:
        raise UserError(f"--device {device!r} is not a device: cpu, cuda, cuda:1, ...") from None
