"""Command line: `python -m kvlib run ...` (one generation run, JSON out)."""

from __future__ import annotations

import argparse
import os
import sys

from kvlib.commands import choose, evaluate, policies, run, study
from kvlib.commands.policy_settings import settings_from_args
from kvlib.errors import UserError

__all__ = ["build_parser", "main", "settings_from_args"]

# the subcommands in the order `kvlib --help` lists them, each module's add_parser and handle
COMMANDS = {"run": run, "eval": evaluate, "policies": policies, "study": study, "choose": choose}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlib", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].handle(args)
    except UserError as exc:
        print(f"kvlib: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
