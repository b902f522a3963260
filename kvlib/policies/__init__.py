"""KV-cache policies, one file each; importing this package registers every one of them."""

from kvlib.policies import (  # noqa: F401  (each registers itself)
    adakv,
    compress_h2o,
    duo,
    flexgen,
    flexgen_h2o,
    full,
    h2o,
    infinigen,
    kivi,
    paged,
    pyramidkv,
    quest,
    snapkv,
    streaming,
)
from kvlib.policies.registry import REGISTRY, available, make_policy, policy_settings, register

__all__ = ["REGISTRY", "available", "make_policy", "policy_settings", "register"]
