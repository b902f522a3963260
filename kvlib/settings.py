"""Settings of anything a params file or the command line names (policies, outside engines): dataclass fields,
checked in one place with one error; and the one conversion of a capacity in GiB to bytes."""

from __future__ import annotations

import dataclasses

from kvlib.errors import UserError

GIB = 2**30


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
