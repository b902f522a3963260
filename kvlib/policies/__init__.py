"""KV-cache policies, one file each; importing this package registers every one of them."""

from kvlib.policies import duo, full, h2o, infinigen, kivi, paged, quest, snapkv, streaming  # noqa: F401  (each registers itself)
from kvlib.policies.registry import REGISTRY, available, make_policy, policy_settings, register

__all__ = ["REGISTRY", "available", "make_policy", "policy_settings", "register"]
