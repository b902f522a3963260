"""`kvlib run`: one generation run with one KV policy (or the real vLLM), its text or one JSON object out."""

from __future__ import annotations

import json
from pathlib import Path

from kvlib.commands.policy_settings import add_placement_arguments, settings_from_args
from kvlib.errors import UserError
from kvlib.settings import capacity_bytes


def add_parser(sub) -> None:
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
    _add_schedule_arguments(run)
    run.add_argument("--json", action="store_true", help="print one JSON object")


def _add_schedule_arguments(run) -> None:
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


def handle(args) -> int:
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
        from kvlib.engine.scheduler import RunSettings, Sequence

        sequences = [Sequence(p, args.max_new_tokens, arrival_step=i * args.arrival_interval,
                              arrival_s=arrivals[i] if arrivals else None) for i, p in enumerate(prompts)]
        result = engine.run(sequences, RunSettings(args.schedule, args.prefill or "chunked", args.chunk_size,
                                                   stop_at_eos=not args.ignore_eos, slo=slo(args),
                                                   compress_share=args.compress_share))
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
