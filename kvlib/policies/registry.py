"""Policy names used by the CLI and params files -> policy classes. A policy registers itself where it is defined."""

from __future__ import annotations

import dataclasses

from kvlib.errors import UserError
from kvlib.settings import construct

REGISTRY: dict[str, type] = {}


def register(cls):
    """Class decorator: `@register` above a policy's dataclass makes it available under its `name`."""
    if cls.name in REGISTRY:
        raise ValueError(f"two policies are named {cls.name!r}")
    REGISTRY[cls.name] = cls
    return cls


def available() -> list[str]:
    return sorted(REGISTRY)


def policy_settings(name: str) -> list[str]:
    return [f.name for f in dataclasses.fields(REGISTRY[name])]


def make_policy(name: str, **settings):
    if name not in REGISTRY:
        raise UserError(f"unknown policy {name!r}; available: {available()}")
    return construct(REGISTRY[name], settings, "policy")
