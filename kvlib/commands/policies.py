"""`kvlib policies`: the registered policies and their settings, or each policy's rules against its official code."""

from __future__ import annotations


def add_parser(sub) -> None:
    pol = sub.add_parser("policies", help="list the registered policies and their settings")
    pol.add_argument("--fidelity", action="store_true",
                     help="each policy's rules against its official code: same, or differs and why")
    pol.add_argument("--markdown", action="store_true", help="with --fidelity: the methods page's table")


def handle(args) -> int:
    from dataclasses import fields

    from kvlib.study.runners import runner_class, runners

    if args.fidelity:
        from kvlib.policies import REGISTRY, fidelity

        if args.markdown:
            print(fidelity.markdown(REGISTRY), end="")
        else:
            for row in fidelity.rows(REGISTRY):
                print(f"{row['policy']}: {row['rule']}: official {row['official']}; kvlib {row['kvlib']}"
                      f"{' (' + row['setting'] + ')' if row['setting'] else ''}: {row['verdict']}")
        return 0

    for name in runners():
        cls = runner_class(name)
        what = f" (an outside engine: {cls.label})" if cls.outside else ""
        print(f"{name}{what}: {', '.join(f.name for f in fields(cls)) or '(no settings)'}")
    return 0
