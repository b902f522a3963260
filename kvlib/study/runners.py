"""What a params file or the command line names to run a workload: a kvlib policy, or an outside engine (the real
vLLM, an extra). Both are a Runner: settings as dataclass fields, capabilities declared as class attributes, one
result type (kvlib.engine.run_result.RunResult). `all` in a params file means every kvlib policy.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

from kvlib.backends.vllm import VLLMBackend
from kvlib.errors import UserError
from kvlib.policies import REGISTRY
from kvlib.settings import construct

BACKENDS = {VLLMBackend.name: VLLMBackend}


class Runner(Protocol):
    name: ClassVar[str]
    label: ClassVar[str]  # how result rows and figures name it
    outside: ClassVar[bool]  # an engine other than kvlib's (the outside baseline)
    lossless: ClassVar[bool]  # keeps and attends every entry (its accuracy is the full cache's)
    supported_prefill: ClassVar[tuple[str, ...]]
    preferred_prefill: ClassVar[str]  # what experiments use when they do not vary the prefill mode
    serving_schedule: ClassVar[str]  # the schedule the serving experiment replays it under (kvlib.engine.scheduler)

    def settings(self) -> dict: ...


def runner_class(name: str) -> type[Runner]:
    cls = REGISTRY.get(name) or BACKENDS.get(name)
    if cls is None:
        raise UserError(f"unknown policy {name!r}; available: {runners()}")
    return cls


def runners() -> list[str]:
    return sorted(REGISTRY) + sorted(BACKENDS)


def make_runner(name: str, **settings) -> Runner:
    cls = runner_class(name)
    return construct(cls, settings, "backend" if cls.outside else "policy")
