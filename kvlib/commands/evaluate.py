"""`kvlib eval`: lm-eval tasks through the engine under one policy and budget, the scores as one JSON object."""

from __future__ import annotations

import json

from kvlib.commands.policy_settings import add_placement_arguments, settings_from_args
from kvlib.settings import DEPLOYED, PROTOCOLS


def add_parser(sub) -> None:
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
    ev.add_argument("--protocol", default=DEPLOYED, choices=PROTOCOLS,
                    help="one_pass: each scored request one masked pass, as the official H2O and InfiniGen harnesses "
                         "run lm-eval (kvlib.evaluation.one_pass); deployed/strict: the context prefilled, the "
                         "continuation scored by decode steps through the policy's cache")


def handle(args) -> int:
    from kvlib.evaluation import KVLibLM
    from kvlib.evaluation.tasks import OFFLINE_TASKS, evaluate, write_offline_tasks
    from kvlib.policies import make_policy
    from kvlib.report.accuracy.tables import accuracy_table

    settings = make_policy(args.policy, **settings_from_args(args)).settings()  # bad settings fail before loading
    lm = KVLibLM(pretrained=args.model, policy=args.policy, batch_size=args.batch_size, device=args.device,
                 protocol=args.protocol, **settings)
    folder = args.include_path
    if folder is None and all(t in OFFLINE_TASKS for t in args.tasks):
        folder = write_offline_tasks(lm.tokenizer, recall_lengths=[256, 512, 1024])
    import pandas as pd

    rows = evaluate(lm, args.tasks, include_path=folder, limit=args.limit)
    frame = pd.DataFrame(rows).assign(policy=args.policy, budget=settings.get("budget"),
                                      kv_share_attended=lm.kv_share_attended)
    table = accuracy_table(frame)
    print(json.dumps({"policy": {"name": args.policy, **settings}, "protocol": args.protocol,
                      "scores": table.to_dict(orient="records"),
                      "items": rows}))
    return 0
