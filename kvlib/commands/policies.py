"""`kvlib policies`: the registered policies and their settings, or each policy's rules against its official code."""

from __future__ import annotations

import textwrap

WIDTH = 100  # a terminal's columns: every line printed fits them
INDENT = "      "  # a setting's meaning, or a rule's verdict, under its name


def add_parser(sub) -> None:
    pol = sub.add_parser("policies", help="list the registered policies, each setting's default and meaning")
    pol.add_argument("--fidelity", action="store_true",
                     help="each policy's rules against its official code (repository and commit): same, or differs "
                          "and why")
    pol.add_argument("--markdown", action="store_true", help="with --fidelity: the methods page's table")


def wrapped(first: str, text: str, indent: str = INDENT) -> str:
    return textwrap.fill(text, WIDTH, initial_indent=first, subsequent_indent=indent, break_on_hyphens=False,
                         break_long_words=True)


def settings_lines(name: str) -> list[str]:
    """A runner's heading, then each setting as `name = default`, its meaning from the profile guide below it."""
    from dataclasses import MISSING, fields

    from kvlib.settings import field_default
    from kvlib.study import profile_guide
    from kvlib.study.runners import runner_class

    cls = runner_class(name)
    # the profile guide's reader: the shared meanings, then each field's own comment in the runner's source
    meanings = {**profile_guide.SETTINGS, **profile_guide._comments(cls)}
    fid = getattr(cls, "fidelity", None)
    for rule in fid.rules if fid else ():  # a setting no comment explains: the rule it sets, as the guide names it
        meanings.setdefault(rule.setting, rule.rule)
    what = f" (an outside engine: {cls.label})" if cls.outside else ""
    lines = [wrapped("", f"{name}{what}" + ("" if fields(cls) else ": no settings"), "  ")]
    for f in fields(cls):
        default = field_default(f)
        shown = "required" if default is MISSING else repr(default)
        lines.append(wrapped(f"  {f.name} = ", shown, INDENT))
        if meanings.get(f.name):
            lines.append(wrapped(INDENT, meanings[f.name]))
    return lines


def fidelity_lines(registry: dict[str, type]) -> list[str]:
    """Each policy under its official repository and commit, then its rules, each with kvlib's verdict."""
    from kvlib.policies import fidelity

    table = fidelity.rows(registry)
    lines = []
    for name in sorted(registry):
        fid = registry[name].__dict__["fidelity"]
        src = fid.source
        lines.append(wrapped("", f"{name}: https://github.com/{src.repo} at commit {src.commit}, {src.file}"
                             + (f" ({fid.note})" if fid.note else ""), "  "))
        for r in (r for r in table if r["policy"] == name):
            setting = f" ({r['setting']})" if r["setting"] else ""
            lines.append(wrapped("  ", f"{r['rule']}: official {r['official']}; kvlib {r['kvlib']}{setting}: "
                                       f"{r['verdict']}", INDENT))
    return lines


def handle(args) -> int:
    from kvlib.study.runners import runners

    if args.fidelity:
        from kvlib.policies import REGISTRY, fidelity

        if args.markdown:
            print(fidelity.markdown(REGISTRY), end="")
        else:
            print("\n".join(fidelity_lines(REGISTRY)))
        return 0

    for name in runners():
        print("\n".join(settings_lines(name)))
    return 0
