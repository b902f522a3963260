"""Where each policy follows its official code and where it departs, rule by rule.

A policy names its official source and the rules that decide its results (budget rule, window, kernel, pooling,
allocation, slots, eviction, split, placement, quantization group, what is kept). Each rule gives the official
value and kvlib's: read from the policy's own setting where the rule is one (so the table follows the code), or
stated where it is a mechanism. Equal values read `same`; a departure must say why (`differs`), and a rule that
says why while the values agree is an error too. `python -m kvlib policies --fidelity` prints the table, the methods
page includes it (book/fidelity.md, written by kvlib.study.book.write_fidelity), and tests/policies/test_fidelity.py
fails when a registered policy has no entry or a rule is unstated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvlib.errors import UserError
from kvlib.settings import field_default


@dataclass(frozen=True)
class Source:
    repo: str  # owner/name
    commit: str  # the commit read
    file: str  # where the rules are, comma-separated where several

    def __str__(self) -> str:
        return f"{self.repo}@{self.commit[:7]} {self.file}"


@dataclass(frozen=True)
class Rule:
    rule: str  # what the rule decides, in a few words
    official: object  # the official code's value or rule
    setting: str | None = None  # the policy setting whose default is kvlib's value (None: a mechanism, see kvlib)
    kvlib: object = None  # kvlib's value where it is no setting
    differs: str = ""  # why kvlib departs (empty: it does not)


@dataclass(frozen=True)
class Fidelity:
    source: Source
    rules: tuple[Rule, ...]
    note: str = ""  # what the source is, where that needs saying (a port, a paper without code)


def kvlib_value(cls, rule: Rule) -> object:
    if rule.setting is None:
        return rule.kvlib
    defaults = {f.name: f for f in dataclasses.fields(cls)}
    if rule.setting not in defaults:
        raise UserError(f"{cls.name}: fidelity rule {rule.rule!r} names setting {rule.setting!r}, which it lacks")
    default = field_default(defaults[rule.setting])
    if default is dataclasses.MISSING:
        raise UserError(f"{cls.name}: setting {rule.setting!r} has no default")
    return default


def verdict(cls, rule: Rule) -> str:
    """`same` or `differs: why`; raises where the declaration contradicts itself."""
    ours = kvlib_value(cls, rule)
    if ours is None:
        raise UserError(f"{cls.name}: fidelity rule {rule.rule!r} states no kvlib value")
    if ours == rule.official:
        if rule.differs:
            raise UserError(f"{cls.name}: rule {rule.rule!r} says it differs, but kvlib's value is the official one")
        return "same"
    if not rule.differs:
        raise UserError(f"{cls.name}: rule {rule.rule!r} departs from the official code ({rule.official!r} there, "
                        f"{ours!r} here) without saying why")
    return f"differs: {rule.differs}"


def rows(registry: dict[str, type]) -> list[dict]:
    out = []
    for name in sorted(registry):
        cls = registry[name]
        fid = cls.__dict__.get("fidelity")  # declared by each class itself: a subclass is another system
        if fid is None:
            raise UserError(f"policy {name!r} declares no fidelity entry (kvlib.policies.fidelity)")
        for rule in fid.rules:
            out.append({"policy": name, "source": str(fid.source), "rule": rule.rule,
                        "official": _text(rule.official), "kvlib": _text(kvlib_value(cls, rule)),
                        "setting": rule.setting or "", "verdict": verdict(cls, rule)})
    return out


def counts(table: list[dict]) -> dict:
    same = sum(r["verdict"] == "same" for r in table)
    return {"same": same, "differs": len(table) - same}


def _text(value: object) -> str:
    return str(value).replace("|", "/")


def markdown(registry: dict[str, type]) -> str:
    """The table as the methods page includes it: the counts, then one small table a policy under its source."""
    table = rows(registry)
    n = counts(table)
    lines = [(f"{n['same']} rules as the official code has them, {n['differs']} where kvlib departs (each departure "
              f"a named setting where it is a choice).")]
    for name in sorted(registry):
        fid = registry[name].__dict__["fidelity"]
        own = [r for r in table if r["policy"] == name]
        same = sum(r["verdict"] == "same" for r in own)
        lines += ["", f"**`{name}`**: {fid.source} ({same} same, {len(own) - same} differ)"
                  + (f". {fid.note}" if fid.note else ""), "",
                  "| rule | official | kvlib (setting) | verdict |", "|---|---|---|---|"]
        for r in own:
            setting = f" (`{r['setting']}`)" if r["setting"] else ""
            lines.append(f"| {r['rule']} | {r['official']} | {r['kvlib']}{setting} | {r['verdict']} |")
    return "\n".join(lines) + "\n"
