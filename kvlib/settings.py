"""Settings of anything a params file or the command line names (policies, outside engines): dataclass fields,
checked in one place with one error; the one conversion of a capacity in GiB to bytes; and the names of the scoring
protocols, one place for the evaluation that runs them and the report and schema that read their rows without
loading lm-eval."""

from __future__ import annotations

import dataclasses

from kvlib.errors import UserError

GIB = 2**30

# How an answer is scored. deployed: the prompt prefilled, the policy's cache built from it, the answer decoded (how a
# server runs it); strict: the prompt's last token fed by a decode step, so the first answer token already reads the
# policy's cache (kvlib.evaluation.generation); one_pass: the official accuracy harnesses' way, one masked pass over
# context and continuation, each query row attending what the policy's accuracy rule keeps (kvlib.evaluation.one_pass).
DEPLOYED, STRICT, ONE_PASS = "deployed", "strict", "one_pass"
DECODED = (DEPLOYED, STRICT)  # the protocols that decode an answer
PROTOCOLS = (*DECODED, ONE_PASS)


def construct(cls, settings: dict, what: str):
    """cls(**settings), with one clear error naming the setting that does not exist and those that do."""
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(settings) - set(allowed))
    if unknown:
        raise UserError(f"{what} {cls.name!r} has no setting {unknown[0]!r}; its settings: {allowed}")
    return cls(**settings)


def field_default(field: dataclasses.Field) -> object:
    """A setting's default (its factory's value where it has one); dataclasses.MISSING where it has none."""
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def capacity_bytes(gib: float | None, what: str = "device_capacity_gb") -> int | None:
    """A device capacity in GiB (None: unlimited) as bytes; one error for a capacity that is not positive."""
    if gib is None:
        return None
    if not isinstance(gib, (int, float)) or isinstance(gib, bool) or gib <= 0:
        raise UserError(f"{what} must be positive (GiB; null or absent: unlimited), got {gib!r}")
    return int(gib * GIB)
