"""`kvlib choose`: which policy for a workload, or which runners meet an SLO at a request rate, read from a profile's
results (kvlib.report.choose); with --hardware, the workload projected onto a machine as well."""

from __future__ import annotations

import json
import sys

from kvlib.errors import UserError
from kvlib.settings import capacity_bytes


def add_parser(sub) -> None:
    pick = sub.add_parser("choose", help="which policy for a workload, read from a profile's results")
    pick.add_argument("--profile", default="embedded", help="a profile's name or YAML file (its results/ are read)")
    pick.add_argument("--prompt-tokens", type=int, default=None, help="required unless --request-rate is given")
    pick.add_argument("--batch", type=int, default=None, help="required unless --request-rate is given")
    pick.add_argument("--output-tokens", type=int, default=None, help="required unless --request-rate is given")
    pick.add_argument("--request-rate", type=float, default=None,
                      help="serving: which runners meet the SLO at this many requests/s (the serving results)")
    pick.add_argument("--slo-ttft", type=float, default=None, help="with --request-rate: the p90 TTFT limit, seconds")
    pick.add_argument("--slo-tpot", type=float, default=None,
                      help="with --request-rate: the p90 time-per-output-token limit, seconds")
    pick.add_argument("--max-accuracy-drop", type=float, default=None,
                      help="percentage points of accuracy a policy may lose against the full cache")
    pick.add_argument("--device-memory-gb", type=float, default=None,
                      help="rule out points whose measured device peak is above this")
    pick.add_argument("--hardware", default=None,
                      help="also project the workload onto this machine (kvlib/hardware/specs: h100_sxm, gh200, ...; or "
                           "a spec file): bounds and estimates, labelled projected, where no measurement exists")
    pick.add_argument("--model", default="llama-3.1-8b", help="with --hardware: the model whose published shape is "
                      "projected")
    pick.add_argument("--json", action="store_true")


def _check_flags(args, workload: list[int | None]) -> None:
    """The flags' combinations and ranges, before any results are read."""
    if args.request_rate is None and None in workload:
        raise UserError("give --prompt-tokens, --batch and --output-tokens (a workload), or --request-rate (serving)")
    if any(v is not None for v in workload) and None in workload:
        raise UserError("--prompt-tokens, --batch and --output-tokens go together")
    for flag in ("prompt_tokens", "batch", "output_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.request_rate is None and (args.slo_ttft is not None or args.slo_tpot is not None):
        raise UserError("--slo-ttft and --slo-tpot go with --request-rate")
    for flag in ("request_rate", "slo_ttft", "slo_tpot"):
        if getattr(args, flag) is not None and not getattr(args, flag) > 0:
            raise UserError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    capacity_bytes(args.device_memory_gb, "--device-memory-gb")
    if args.hardware is not None and None in workload:
        raise UserError("--hardware projects a workload: give --prompt-tokens, --batch and --output-tokens")


def handle(args) -> int:
    from dataclasses import asdict

    from kvlib.report.choose import choose, choose_serving
    from kvlib.study import load_profile, reference, stored

    workload = [args.prompt_tokens, args.batch, args.output_tokens]
    _check_flags(args, workload)
    loaded = load_profile(args.profile)
    profile, gate = loaded.name, loaded.validity_gate
    if reference.stands_in(profile):  # (stderr: --json prints one object)
        print(f"reading the reference book's rows ({reference.provenance(reference.about(profile))})", file=sys.stderr)
    frames = {e: stored(profile, e) for e in ("ttft", "batch_scaling", "decode_length", "serving", "accuracy")}
    answers = {}
    if args.request_rate is not None:
        if frames["serving"].empty:
            raise UserError(f"no serving results for profile {profile!r} yet: `kvlib study --profile {args.profile} "
                            f"--experiments serving` computes them")
        answers["serving"] = choose_serving(frames["serving"], frames["accuracy"], args.request_rate, args.slo_ttft,
                                            args.slo_tpot, args.max_accuracy_drop, args.device_memory_gb, gate)
    if None not in workload:
        if frames["batch_scaling"].empty and frames["ttft"].empty:
            raise UserError(f"no results for profile {profile!r} yet: `kvlib study --profile {args.profile}` computes "
                            f"them")
        answers["workload"] = choose(frames, args.prompt_tokens, args.batch, args.output_tokens,
                                     args.max_accuracy_drop, args.device_memory_gb, gate)
    if args.hardware is not None:
        from kvlib.report.choose import choose_projected

        answers["projected"] = choose_projected(args.model, args.hardware, args.prompt_tokens, args.batch,
                                                args.output_tokens, profile)
    if args.json:
        answer = {k: asdict(v) for k, v in answers.items()}
        print(json.dumps(answer["workload"] if list(answer) == ["workload"] else answer))
    else:
        print("\n\n".join(a.text() for a in answers.values()))
    return 0
