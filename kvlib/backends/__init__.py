"""Outside inference engines run on the same workloads as kvlib's policies, returning the same RunResult.

A params file or the CLI names a kvlib policy or a backend alike ("runners"); `all` means kvlib's policies.
"""

from __future__ import annotations

import dataclasses

from kvlib.backends.vllm import VLLMBackend
from kvlib.policies import REGISTRY

BACKENDS = {VLLMBackend.name: VLLMBackend}


def runner_class(name: str):
    return REGISTRY.get(name) or BACKENDS.get(name)


def runners() -> list[str]:
    return sorted(REGISTRY) + sorted(BACKENDS)


def runner_settings(name: str) -> list[str]:
    cls = runner_class(name)
    return [f.name for f in dataclasses.fields(cls)] if cls is not None else []
