"""The checks a profile's values go through (kvlib.study.schema): each returns a value's problem or None, and says its
type in words for the profile guide (kvlib.study.profile_guide). An experiment declares its workload's checks with
them (kvlib.study.experiment)."""

from __future__ import annotations

from collections.abc import Callable

Check = Callable[[object], str | None]  # a value's problem, or None


def described(words: str):
    """A check's type in words, for the profile guide (kvlib.study.profile_guide)."""
    def mark(check: Check) -> Check:
        check.kind = words
        return check
    return mark


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@described("a positive integer")
def positive_int(v):
    return None if is_int(v) and v >= 1 else f"expected a positive integer, got {v!r}"


@described("an integer >= 0")
def non_negative_int(v):
    return None if is_int(v) and v >= 0 else f"expected an integer >= 0, got {v!r}"


@described("a positive number")
def positive_number(v):
    return None if is_number(v) and v > 0 else f"expected a positive number, got {v!r}"


@described("a share in (0, 1]")
def share(v):
    return None if is_number(v) and 0 < v <= 1 else f"expected a share in (0, 1], got {v!r}"


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
    ok = isinstance(v, list) and len(v) == 2 and all(is_int(x) and x >= 1 for x in v) and v[0] < v[1]
    return None if ok else f"expected a bucket [low, high] of token counts, low < high, got {v!r}"


@described("a depth in [0, 1]")
def depth(v):
    return None if is_number(v) and 0 <= v <= 1 else f"expected a depth in [0, 1], got {v!r}"


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
