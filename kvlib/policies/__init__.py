"""Registry: policy names used by the CLI and params files -> policy classes (one file per policy)."""

from __future__ import annotations

import dataclasses

from kvlib.errors import UserError
from kvlib.policies.base import KVPolicy
from kvlib.policies.full import FullPolicy
from kvlib.policies.h2o import HeavyHitterPolicy
from kvlib.policies.infinigen import InfiniGenPolicy
from kvlib.policies.paged import PagedPolicy

REGISTRY: dict[str, type[KVPolicy]] = {}


def register(cls: type[KVPolicy]) -> type[KVPolicy]:
    REGISTRY[cls.name] = cls
    return cls


register(FullPolicy)
register(HeavyHitterPolicy)
register(InfiniGenPolicy)
register(PagedPolicy)


def available() -> list[str]:
    return sorted(REGISTRY)


def policy_settings(name: str) -> list[str]:
    return [f.name for f in dataclasses.fields(REGISTRY[name])]


def make_policy(name: str, **settings) -> KVPolicy:
    if name not in REGISTRY:
        raise UserError(f"unknown policy {name!r}; available: {available()}")
    allowed = policy_settings(name)
    unknown = sorted(set(settings) - set(allowed))
    if unknown:
        raise UserError(f"policy {name!r} has no setting {unknown[0]!r}; its settings: {allowed}")
    return REGISTRY[name](**settings)
