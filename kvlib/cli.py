"""Command line: `python -m kvlib run ...` (one generation run, JSON out)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kvlib.errors import UserError
from kvlib.settings import capacity_bytes


def _setting_value(text: str):
    """Policy settings from `--set key=value`: numbers, booleans and None parsed, anything else a string."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


# the policies that place their cache across device, host and disk (FlexGen's settings)
PLACED_POLICIES = ("flexgen", "flexgen_h2o")


def add_placement_arguments(parser) -> None:
    parser.add_argument("--percent", type=float, nargs=6, default=None,
                        metavar=("W_DEV", "W_HOST", "KV_DEV", "KV_HOST", "ACT_DEV", "ACT_HOST"),
                        help="FlexGen's placement: percent of the weights, the KV cache and the activations on the "
                             "device and the host, the disk taking the rest (policies flexgen, flexgen_h2o)")
    parser.add_argument("--offload-dir", default=None,
                        help="folder for the disk tier's files (default: kvlib's cache folder, offload/)")
    parser.add_argument("--compress-cache", action="store_true",
                        help="keep the KV cache in 4 bits (groups of 64 along the head dim, FlexGen's format)")
    parser.add_argument("--gpu-batch-size", type=int, default=None,
                        help="rows of a micro-batch (FlexGen's GPU batch): each layer runs on each micro-batch of the "
                             "batch in turn, its weights loaded once for all of them (default: the batch is one)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlib", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="generate for one or more prompt files with one KV policy")
    run.add_argument("--model", default="smollm2-135m",
                     help="embedded name, local folder, Hugging Face id, or a named architecture (--weights random): "
                          "llama-3.1-8b, llama-3.1-70b, gpt-oss-20b")
    run.add_argument("--weights", choices=["pretrained", "random"], default="pretrained",
                     help="random: the model's shape with seeded random weights, no tokenizer (prompts from "
                          "--prompt-tokens; outputs are token ids, not text): systems figures only")
    run.add_argument("--num-layers", type=int, default=None,
                     help="with --weights random: keep only the first layers (a paper-size model on a CPU)")
    run.add_argument("--prompt-tokens", type=int, action="append", default=[], metavar="N",
                     help="a prompt of N token ids (random ids with --weights random, else CPython docs text; repeat "
                          "for a batch)")
    run.add_argument("--policy", default="full", help="KV-cache policy (see `kvlib policies`)")
    run.add_argument("--prefill", default=None,
                     help="prefill mode: full | fused | chunked (default: fused; chunked under --schedule continuous "
                          "or compress, whole prompts at admission with full or fused)")
    run.add_argument("--chunk-size", type=int, default=512, help="tokens per chunk for --prefill chunked")
    run.add_argument("--max-new-tokens", type=int, default=32)
    run.add_argument("--prompt-file", action="append", default=[], help="raw text prompt (repeat for a batch)")
    run.add_argument("--batch-size", type=int, default=None,
                     help="repeat the prompt files cyclically up to this many requests")
    run.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    run.add_argument("--budget", type=float, default=None, help="KV budget (fraction of the prompt) for sparse policies")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other policy setting")
    add_placement_arguments(run)
    run.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    run.add_argument("--device-capacity-gb", type=float, default=None,
                     help="device memory capacity; exceeding it ends the run as a recorded OOM")
    run.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens tokens")
    run.add_argument("--schedule", choices=["static", "continuous", "compress"], default="static",
                     help="static: prefill each prompt, then decode the batch; continuous: requests join and leave "
                          "between decode steps (a full pool preempts a request, as vLLM does); compress: as "
                          "continuous, but a full pool first compacts a running request's cache by its policy's "
                          "scores (h2o, snapkv; compress_h2o, every entry until then and never below its budget, serves "
                          "under it in the serving experiment)")
    run.add_argument("--compress-share", type=float, default=None,
                     help="with --schedule compress: the share of its entries a compacted request keeps (default: the "
                          "policy's compress_share setting where it has one, as compress_h2o does, else 0.5)")
    run.add_argument("--arrival-interval", type=int, default=0,
                     help="with --schedule continuous: request i arrives at decode step i * this")
    run.add_argument("--request-rate", type=float, default=None,
                     help="with --schedule continuous: requests per second, arriving as a seeded Poisson process "
                          "(inf: all at once); latencies and goodput as `vllm bench serve` reports them")
    run.add_argument("--burstiness", type=float, default=1.0,
                     help="with --request-rate: the gamma shape of the gaps (1: Poisson; below 1 burstier)")
    run.add_argument("--num-requests", type=int, default=None,
                     help="with --request-rate: this many requests, the prompts taken in turn (default: one each)")
    run.add_argument("--slo-ttft", type=float, default=None, help="goodput's TTFT limit, in seconds")
    run.add_argument("--slo-tpot", type=float, default=None, help="goodput's time-per-output-token limit, in seconds")
    run.add_argument("--json", action="store_true", help="print one JSON object")
    ev = sub.add_parser("eval", help="lm-eval tasks through the engine under one policy and budget")
    ev.add_argument("--model", default="smollm2-135m")
    ev.add_argument("--policy", default="full")
    ev.add_argument("--budget", type=float, default=None, help="fraction of KV entries each layer may keep")
    ev.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other policy setting")
    add_placement_arguments(ev)
    ev.add_argument("--tasks", nargs="+", default=["kvlib_recall"],
                    help="kvlib_recall / kvlib_pydoc_perplexity (generated offline), or lm-eval task names")
    ev.add_argument("--include-path", default=None, help="a folder of lm-eval task configs (local tasks)")
    ev.add_argument("--limit", type=int, default=None, help="items per task")
    ev.add_argument("--batch-size", type=int, default=8)
    ev.add_argument("--device", default=None)
    pol = sub.add_parser("policies", help="list the registered policies and their settings")
    pol.add_argument("--fidelity", action="store_true",
                     help="each policy's rules against its official code: same, or differs and why")
    pol.add_argument("--markdown", action="store_true", help="with --fidelity: the methods page's table")
    study = sub.add_parser("study", help="run a profile's experiments (resumable) and execute the notebooks")
    study.add_argument("--profile", default="embedded",
                       help="a profile's name (params/<name>.yaml) or a path to your own YAML file (its results go "
                            "to results/<file name without .yaml>/)")
    study.add_argument("--experiments", nargs="+", default=None, help="a subset of the profile's experiments")
    study.add_argument("--force", action="store_true", help="recompute points already in results/")
    study.add_argument("--build", action="store_true", help="then build the HTML book (book/_build/html)")
    study.add_argument("--policies", nargs="+", default=None,
                       help="only these policies / backends (e.g. every kvlib policy where vLLM is not installed); "
                            "the book then shows what is stored and says what is missing")
    study.add_argument("--compute-only", action="store_true",
                       help="store the results only, no notebooks (a GPU machine without the book's packages)")
    study.add_argument("--executor", choices=["serial", "ray"], default="serial",
                       help="serial: every point in this process; ray: on a Ray cluster (the `distributed` extra)")
    study.add_argument("--address", default=None,
                       help="with --executor ray: the cluster to join (`ray start --head` prints it); default: start "
                            "Ray on this machine")
    study.add_argument("--gpus-per-point", type=float, default=0, help="with --executor ray: GPUs each worker holds")
    study.add_argument("--cpus-per-point", type=float, default=1, help="with --executor ray: CPUs each worker holds")
    study.add_argument("--device", default=None,
                       help="run on this device (cpu, cuda, ...) instead of the profile's; with --compute-only, its "
                            "results go to results/<profile>-<device>/")
    study.add_argument("--toy", action="store_true",
                       help="the profile at its own toy size (its `toy:` values): the same policies and code paths in "
                            "seconds; with --compute-only, its results go to results/<profile>-toy[-<device>]/")
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
    return parser


def read_prompts(args, tokenizer) -> list[list[int]]:
    from kvlib.models.workloads import prompt_of_length

    if not args.prompt_file and not args.prompt_tokens:
        raise UserError("give at least one --prompt-file or --prompt-tokens")
    if any(n < 1 for n in args.prompt_tokens):
        raise UserError(f"--prompt-tokens must be >= 1, got {min(args.prompt_tokens)}")
    prompts = []
    for name in args.prompt_file:
        try:
            text = Path(name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read prompt file {name!r}: {exc.strerror if isinstance(exc, OSError) else exc}")
        if args.chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
        else:
            ids = tokenizer(text)["input_ids"]
        prompts.append(list(ids))
    prompts += [prompt_of_length(tokenizer, n, offset=1000 * i) for i, n in enumerate(args.prompt_tokens)]
    if args.batch_size is not None:
        if args.batch_size < 1:
            raise UserError(f"--batch-size must be >= 1, got {args.batch_size}")
        prompts = [prompts[i % len(prompts)] for i in range(args.batch_size)]
    return prompts


def settings_from_args(args) -> dict:
    from kvlib.policies import REGISTRY, policy_settings

    settings = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"--set needs KEY=VALUE, got {item!r}")
        settings[key.replace("-", "_")] = _setting_value(value)
    if args.budget is not None:
        settings["budget"] = args.budget
    share = getattr(args, "compress_share", None)
    if share is not None and args.policy in REGISTRY and "compress_share" in policy_settings(args.policy):
        settings["compress_share"] = share  # one value: the policy's own setting is the share the schedule uses
    placement = {k: v for k, v in (("percent", args.percent), ("offload_dir", args.offload_dir),
                                   ("compress_cache", args.compress_cache or None),
                                   ("gpu_batch_size", args.gpu_batch_size)) if v is not None}
    if placement and args.policy not in PLACED_POLICIES:
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in placement)
        raise UserError(f"{flags}: placing the KV cache across device, host and disk is supported by policies "
                        f"{' and '.join(PLACED_POLICIES)} (FlexGen: the full cache; FlexGen + H2O), not by policy "
                        f"{args.policy!r}")
    if "percent" in placement:
        placement["percent"] = " ".join(f"{v:g}" for v in placement["percent"])
    return {**settings, **placement}


def run_backend(args, backend):
    """`--policy vllm`: the same prompts through the real vLLM (its own scheduling and prefill)."""
    from transformers import AutoTokenizer

    from kvlib.backends.vllm import check_weights
    from kvlib.models import model_config, resolve_model_path
    from kvlib.models.random_tokens import NoTextTokenizer

    random = args.weights == "random"
    check_weights(args.model, args.weights)  # before a tokenizer is looked for
    if random:
        tokenizer = NoTextTokenizer(args.model, model_config(args.model).vocab_size)
    else:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    prompts, arrivals = requests(args, read_prompts(args, tokenizer))
    # random weights may emit an end-of-sequence id at any step: lengths stay fixed, as in kvlib's engine
    return backend.generate(args.model, prompts, args.max_new_tokens, stop_at_eos=not (args.ignore_eos or random),
                            device_capacity_bytes=capacity_bytes(args.device_capacity_gb, "--device-capacity-gb"),
                            weights=args.weights, arrivals=arrivals, slo=slo(args))


def requests(args, prompts: list[list[int]]) -> tuple[list[list[int]], list[float] | None]:
    """The prompts served and when each arrives (seconds; None: all at the start), from --request-rate."""
    from kvlib.engine.arrivals import arrival_times

    if args.request_rate is None:
        if args.num_requests is not None:
            raise UserError("--num-requests goes with --request-rate")
        return prompts, None
    if args.schedule == "static" and args.policy != "vllm":
        raise UserError("--request-rate serves requests as they arrive: use --schedule continuous (or compress)")
    n = args.num_requests or len(prompts)
    return [prompts[i % len(prompts)] for i in range(n)], arrival_times(n, args.request_rate, args.burstiness)


def slo(args) -> dict:
    return {k: v for k, v in (("ttft_s", args.slo_ttft), ("tpot_s", args.slo_tpot)) if v is not None}


def cmd_run(args) -> int:
    from kvlib.engine import Engine
    from kvlib.models import load_model
    from kvlib.study.runners import make_runner

    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    capacity = capacity_bytes(args.device_capacity_gb, "--device-capacity-gb")  # before any model loads
    runner = make_runner(args.policy, **settings_from_args(args))  # bad settings fail before the model loads, too
    if runner.outside:
        return print_result(args, run_backend(args, runner))
    model = load_model(args.model, device=args.device, weights=args.weights, num_layers=args.num_layers)
    prompts = read_prompts(args, model.tokenizer)
    engine = Engine(model, runner, device_capacity_bytes=capacity)
    prompts, arrivals = requests(args, prompts)
    if args.schedule != "static":
        from kvlib.engine.scheduler import Sequence, run

        sequences = [Sequence(p, args.max_new_tokens, arrival_step=i * args.arrival_interval,
                              arrival_s=arrivals[i] if arrivals else None) for i, p in enumerate(prompts)]
        result = run(engine, sequences, args.schedule, args.prefill or "chunked", args.chunk_size,
                     stop_at_eos=not args.ignore_eos,
                     slo=slo(args), compress_share=args.compress_share)
    else:
        result = engine.generate(prompts, args.max_new_tokens, prefill_mode=args.prefill or "fused",
                                 chunk_size=args.chunk_size, stop_at_eos=not args.ignore_eos)
    return print_result(args, result)


def print_result(args, result) -> int:
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        for i, out in enumerate(result.outputs):
            print(f"--- prompt {i} ({out['prompt_tokens']} tokens)\n{out['text']}")
        m = result.metrics
        if result.oom:
            print(f"OOM during {result.oom['phase']} at {result.oom['where']}")
        else:
            print(f"TTFT {m['ttft_s']:.3f}s, decode {m['decode_tokens_per_s'] or 0:.1f} tok/s, "
                  f"device KV {result.memory['device']['kv_bytes'] / 2**20:.1f} MiB")
    return 0


def cmd_eval(args) -> int:
    from kvlib.evaluation import KVLibLM
    from kvlib.evaluation.tasks import OFFLINE_TASKS, evaluate, write_offline_tasks
    from kvlib.policies import make_policy
    from kvlib.report.tables import accuracy_table

    settings = make_policy(args.policy, **settings_from_args(args)).settings()  # bad settings fail before loading
    lm = KVLibLM(pretrained=args.model, policy=args.policy, batch_size=args.batch_size, device=args.device,
                 **settings)
    folder = args.include_path
    if folder is None and all(t in OFFLINE_TASKS for t in args.tasks):
        folder = write_offline_tasks(lm.tokenizer, recall_lengths=[256, 512, 1024])
    import pandas as pd

    rows = evaluate(lm, args.tasks, include_path=folder, limit=args.limit)
    table = accuracy_table(pd.DataFrame(rows).assign(policy=args.policy, budget=settings.get("budget")))
    print(json.dumps({"policy": {"name": args.policy, **settings}, "scores": table.to_dict(orient="records"),
                      "items": rows}))
    return 0


def cmd_policies(args) -> int:
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


def cmd_study(args) -> int:
    from kvlib.study import run_study

    executor = None
    if args.executor == "ray":
        from kvlib.study.ray_executor import RayExecutor

        executor = RayExecutor(args.address, gpus_per_point=args.gpus_per_point, cpus_per_point=args.cpus_per_point)
    elif args.address is not None or args.gpus_per_point or args.cpus_per_point != 1:
        raise UserError("--address, --gpus-per-point and --cpus-per-point need --executor ray")
    run_study(args.profile, args.experiments, force=args.force, build=args.build, policies=args.policies,
              notebooks=not args.compute_only, executor=executor, device=args.device, toy=args.toy)
    return 0


def cmd_choose(args) -> int:
    from dataclasses import asdict

    from kvlib.report.choose import choose, choose_serving
    from kvlib.study import load_profile, results

    workload = [args.prompt_tokens, args.batch, args.output_tokens]
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
    loaded = load_profile(args.profile)
    profile, gate = loaded.name, loaded.validity_gate
    frames = {e: results.load(profile, e) for e in ("ttft", "batch_scaling", "decode_length", "serving", "accuracy")}
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


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        return {"run": cmd_run, "eval": cmd_eval, "policies": cmd_policies, "study": cmd_study,
                "choose": cmd_choose}[args.command](args)
    except UserError as exc:
        print(f"kvlib: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
