"""`kvlib choose`: which policy for a workload, or which runners meet an SLO at a request rate, read from a profile's
results (kvlib.report.choose); with --hardware, the workload projected onto a machine as well."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from kvlib.errors import UserError
from kvlib.settings import capacity_bytes

MODEL = "llama-3.1-8b"  # the model --hardware projects unless --model names another


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
                      help="percentage points of accuracy a policy may lose against the full cache, 0 to 100; "
                           "without it the lossy policies are listed apart, not ranked")
    pick.add_argument("--device-memory-gb", type=float, default=None,
                      help="rule out points whose measured device peak is above this")
    pick.add_argument("--hardware", default=None,
                      help="also project the workload onto this machine (kvlib/hardware/specs: h100_sxm, gh200, ...; or "
                           "a spec file): bounds and estimates, labelled projected, where no measurement exists")
    pick.add_argument("--model", default=None, help=f"with --hardware: the model whose published shape is "
                      f"projected (default {MODEL})")
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
    if args.max_accuracy_drop is not None and not 0 <= args.max_accuracy_drop <= 100:
        raise UserError(f"--max-accuracy-drop is percentage points of accuracy, 0 to 100, got {args.max_accuracy_drop:g}")
    capacity_bytes(args.device_memory_gb, "--device-memory-gb")
    if args.hardware is not None and None in workload:
        raise UserError("--hardware projects a workload: give --prompt-tokens, --batch and --output-tokens")
    if args.model is not None and args.hardware is None:
        raise UserError("--model goes with --hardware (the model projected onto that machine)")
    if args.hardware is not None:
        from kvlib import hardware
        from kvlib.models import architectures

        hardware.load(args.hardware)  # an unknown name is refused here, before any result is read
        model = args.model or MODEL
        if not architectures.is_architecture(model) and not Path(model).is_dir():
            raise UserError(f"--model must be one of {', '.join(architectures.names())} or a model's folder, "
                            f"got {model!r}")


def handle(args) -> int:
    from dataclasses import asdict

    from kvlib.report.choose.serving import choose_serving
    from kvlib.report.choose.workload import choose
    from kvlib.report.study_rows import StudyRows
    from kvlib.study import load_profile, stored

    workload = [args.prompt_tokens, args.batch, args.output_tokens]
    _check_flags(args, workload)
    loaded = load_profile(args.profile)
    profile, gate = loaded.name, loaded.validity_gate
    rows = StudyRows(lambda experiment: stored(profile, experiment))
    answers = {}
    if args.request_rate is not None:
        if rows.serving.empty:
            raise UserError(f"no serving results for profile {profile!r} yet: `kvlib study --profile {args.profile} "
                            f"--experiments serving` computes them")
        answers["serving"] = choose_serving(rows.serving, rows.accuracy, args.request_rate, args.slo_ttft,
                                            args.slo_tpot, args.max_accuracy_drop, args.device_memory_gb, gate)
    if None not in workload:
        if rows.batch_scaling.empty and rows.ttft.empty:
            raise UserError(f"no results for profile {profile!r} yet: `kvlib study --profile {args.profile}` computes "
                            f"them")
        answers["workload"] = choose(rows, args.prompt_tokens, args.batch, args.output_tokens,
                                     args.max_accuracy_drop, args.device_memory_gb, gate,
                                     rank_lossy=args.max_accuracy_drop is not None)
    if args.hardware is not None:
        from kvlib.report.choose.projected import choose_projected

        # first: asked for another machine, the user reads its projection before this machine's measurements
        answers = {"projected": choose_projected(args.model or MODEL, args.hardware, args.prompt_tokens, args.batch,
                                                 args.output_tokens, profile, args.device_memory_gb,
                                                 answers.get("workload"), loaded.systems_runners()), **answers}
    about = _about(profile, list(rows.read.values()))  # the rows the answers read
    if args.json:
        answer = {k: asdict(v) for k, v in answers.items()}
        print(json.dumps({**about, **(answer["workload"] if list(answer) == ["workload"] else answer)}))
    else:
        head = (f"The {about['profile']} profile's rows from {about['source']}: model {about['model']}, measured on "
                f"{about['machine']}.")
        texts = [_wrapped(a.text()) for a in answers.values()]
        # the source leads a workload's answer; a serving answer keeps its own first line (its rate and SLO)
        print("\n\n".join([_wrapped(head), *texts] if list(answers) != ["serving"] else [*texts, _wrapped(head)]))
    return 0


WIDTH = 100  # a terminal's width the answer keeps within


def _wrapped(text: str) -> str:
    """Each line of an answer within WIDTH columns, its continuation indented."""
    return "\n".join(textwrap.fill(line, WIDTH, subsequent_indent="  ", break_long_words=False,
                                    break_on_hyphens=False) if line else line for line in text.splitlines())


def _about(profile: str, frames: list) -> dict:
    """Where the answer's rows come from: the profile, its source (the reference book, or this checkout's results),
    the model(s) the rows measured and the machine they ran on."""
    from kvlib.paths import read_from, repo_root
    from kvlib.study import reference

    models = sorted({m for df in frames if "model" in df for m in df["model"].dropna().unique()})
    if reference.stands_in(profile):
        info = reference.about(profile)
        source = (f"the reference book (computed on {info['computed_between'][1][:10]} at commit(s) "
                  f"{', '.join(info['computed_at_commits'])})")
        machine = f"a {info['machine']['threads']}-thread {info['machine']['cpu']} ({info['machine']['host']})"
    else:
        folder = read_from(profile)
        source = str(folder.relative_to(repo_root()) if folder.is_relative_to(repo_root()) else folder)
        names = sorted({d for df in frames for column in ("device_name", "device") if column in df
                        for d in df[column].dropna().astype(str).unique()})
        machine = ", ".join(names) or "a machine the rows do not name"
    return {"profile": profile, "source": source, "model": ", ".join(models) or "none measured", "machine": machine}
