"""Accuracy per task and KV budget through lm-eval (paper Fig. 7): one row per item.

A point's `protocol` says how a log-likelihood request is scored: by decode steps through the policy's cache after a
dense prefill (kvlib.evaluation.lm; its rows say `strict`), or, under `one_pass`, as the official H2O and InfiniGen
harnesses run lm-eval, one masked pass a request (kvlib.evaluation.one_pass): the paper's six tasks run so in the
profiles' arms.

Every point of a model shares one process-level PrefillStore (kvlib.engine.prefill_record): the points of a task run
the same items, so each item's dense prefill is computed once and every policy that adopts one takes it from there
(each item's result is the one its own prefill gives). The store holds at most `prefill_store_gb` (a fixed value of
the experiment; a quarter of the machine's memory by default), least recently used records first out: it pays when
it holds one task's items in one arithmetic, so the points run task by task and, within a task, the policies that
prefill alike together (`order`). A point's `prefill` (one mode for every policy, `full` in the embedded profile)
makes every policy adopt the same record of an item: one recording pass an item instead of one per arithmetic.
"""

import gc

from kvlib.engine.prefill_record import PrefillStore, default_store_bytes
from kvlib.evaluation import KVLibLM
from kvlib.evaluation.ruler import RULER_TASKS, evaluate_ruler
from kvlib.evaluation.tasks import evaluate, write_offline_tasks
from kvlib.models import LoadedModel
from kvlib.models.workloads import calibration_prompt
from kvlib.report.accuracy import lines as chapter
from kvlib.report.pages import ACCURACY
from kvlib.settings import DEPLOYED, ONE_PASS, PROTOCOLS, STRICT
from kvlib.study.checks import (
    depth,
    list_of,
    mapping_of,
    non_negative_int,
    one_of,
    optional,
    positive_int,
    positive_number,
    text,
)
from kvlib.study.experiment import Experiment, register
from kvlib.study.experiments.common import model_of
from kvlib.study.runners import runner_class


def model_and_store(point, kept) -> tuple[LoadedModel, PrefillStore]:
    """The point's model and this process's prefill store for it: one store for every point of a model. Where the
    model changes, the last model's store is dropped before the new model loads (a 16 GB store of SmolLM2's kept while
    Qwen2.5-Coder-1.5B loaded filled the 24 GB machine), and a fresh store drops the process's other models before it
    fills: a worker holds one model beside its store, as kvlib.study.executor.worker_gib counts it."""
    key = (point.model, point.device, point.weights)
    max_gb = point.values.get("prefill_store_gb")
    max_bytes = None if max_gb is None else int(max_gb * 2**30)
    held = kept.once.get(PrefillStore)  # (the model key it serves, its store)
    if held is not None and (held[0] != key or (max_bytes is not None and held[1].max_bytes != max_bytes)):
        del kept.once[PrefillStore]
        held = None  # its last reference: the store's records are freed before the new model loads
        gc.collect()
    loaded = model_of(point, kept)
    if held is None:
        kept.only(loaded)
        held = kept.once[PrefillStore] = (key, PrefillStore(max_bytes))
    return loaded, held[1]


def order(point) -> tuple:
    """The executor's order for this experiment's points: task by task, and within a task by the prefill mode the
    policy scores under (a record serves the modes of one arithmetic), so that the store holds what the next point
    reads."""
    runner = runner_class(point.runner)
    return point.values["task"], point.values.get("prefill", runner.preferred_prefill)


def held_gib(point) -> float:
    """What a worker holds for this point beside its model: the prefill store, which the one-pass protocol never
    fills (it scores without the engine)."""
    if point.values.get("protocol") == ONE_PASS:
        return 0.0
    gb = point.values.get("prefill_store_gb")
    return default_store_bytes() / 2**30 if gb is None else gb


def run_point(point, kept) -> list[dict]:
    v = point.values
    loaded, store = model_and_store(point, kept)
    protocol = v.get("protocol", DEPLOYED)
    lm = KVLibLM(policy=point.runner, loaded=loaded, batch_size=v.get("batch_size", 8), protocol=protocol,
                 prefill=v.get("prefill"),
                 calibration=calibration_prompt(loaded, v.get("calibration_source")),
                 prefill_store=store, **point.settings)
    if v["task"] in RULER_TASKS:  # lm-eval's RULER: items sized per length (kvlib.evaluation.ruler)
        rows = evaluate_ruler(lm, v["task"], loaded.tokenizer.name_or_path, **(v.get("ruler") or {}))
        rows = [{**row, "protocol": protocol} for row in rows]
    else:
        offline = v.get("offline_tasks")
        folder = write_offline_tasks(loaded.tokenizer, **offline) if offline else None
        rows = evaluate(lm, [v["task"]], include_path=folder, limit=v.get("limit"))
        # a scored continuation comes from decode steps (kvlib.evaluation.lm), strict whatever the point says, or
        # from the official harnesses' one masked pass (kvlib.evaluation.one_pass)
        scored_by = protocol if protocol == ONE_PASS else STRICT
        rows = [{**row, "kv_share_attended": lm.kv_share_attended, "protocol": scored_by} for row in rows]
    held = held_columns(lm, loaded.spec.kv_bytes_per_token)
    return [{**row, **held} for row in rows]


def held_columns(lm: KVLibLM, full_bytes_per_token: int) -> dict:
    """What the policy held on the device while it answered (KVUsage): its KV bytes per token seen, and as a share of
    the full cache's at the model's dtype; for InfiniGen with measure_coverage, its speculation's share of the true
    attention mass against the oracle's (KVLibLM.speculation_columns); for a policy that calibrates, what its
    calibration chose (KVPolicy.calibration_columns: duo's retrieval ratio and how stable its heads are)."""
    per_token = lm.kv_device_bytes_per_token
    columns = {"kv_device_bytes_per_token": per_token,
               "kv_share_held": None if per_token is None else per_token / full_bytes_per_token,
               **lm.speculation_columns}
    return {**columns, **lm.engine.policy.calibration_columns()}


def _items(fixed: dict, task: str) -> str:
    """A task's items per point as a profile's fixed values set them (`limit` takes the first items)."""
    offline, ruler = fixed.get("offline_tasks") or {}, fixed.get("ruler") or {}
    if task == "kvlib_recall" and "recall_items" in offline:
        n = offline["recall_items"] * len(offline.get("recall_lengths", [None]))
    elif task.startswith(("niah_", "ruler_")) and "items" in ruler:
        n = ruler["items"] * len(ruler.get("max_seq_lengths", [None]))
    else:
        n = None
    limit = fixed.get("limit")
    n = min(n, limit) if n and limit else n or limit
    return f"{task}: {n:,} items" if n else f"{task}: every item"


def _arm_row(name: str, accuracy: dict, arm: dict) -> str:
    """An accuracy arm's row: its policies and what sets them apart (rule, alpha, protocol, model), budgets, items."""
    fixed = {**accuracy["fixed"], **arm.get("fixed", {})}
    grid = arm.get("grid", {})
    apart = [f"{k} {fixed[k]:g}" if isinstance(fixed[k], float) else f"{k} {fixed[k]}"
             for k in ("protocol", "budget_rule", "alpha") if k in arm.get("fixed", {})]
    model = f"; {arm['model']}" if arm.get("model") else ""
    label = f"accuracy ({', '.join(apart)}{model}{', exploratory' if arm.get('role') == 'exploratory' else ''})"
    budgets = ", ".join(f"{b:g}" for b in grid.get("budget", []))
    items = fixed.get("limit")
    tasks = ", ".join(grid.get("task", []))
    return (f"| `{name}` | {label} | {', '.join(arm['policies'])} | {budgets} | "
            f"{tasks}: {f'{items:,} items' if items else 'every item'} each, paired |")


def sizes(name: str, accuracy: dict) -> list[str]:
    """The methods page's rows of a profile's accuracy grid (kvlib.study.methods_figures.sizes): the tested
    policies, the exploratory ones and each arm, with their budgets and items."""
    exploratory = accuracy.get("exploratory") or {}
    tasks, budgets = accuracy["grid"]["task"], ", ".join(f"{b:g}" for b in accuracy["grid"]["budget"])
    tested = [p for p in accuracy["policies"] if p not in exploratory.get("policies", [])]
    rows = [f"| `{name}` | accuracy | {', '.join(tested)} | {budgets} | "
            + "; ".join(_items(accuracy["fixed"], t) for t in tasks) + ", paired |"]
    if exploratory:
        fixed = {**accuracy["fixed"], **exploratory.get("fixed", {})}
        rows.append(f"| `{name}` | accuracy (exploratory) | {', '.join(exploratory['policies'])} | {budgets} | "
                    + "; ".join(_items(fixed, t) for t in tasks) + ", paired |")
    return rows + [_arm_row(name, accuracy, arm) for arm in accuracy.get("arms") or []]


RULER = mapping_of({"max_seq_lengths": list_of(positive_int), "items": optional(positive_int),
                    "max_gen_toks": optional(positive_int)})
OFFLINE_TASKS = mapping_of({"recall_lengths": list_of(positive_int), "recall_items": positive_int,
                            "recall_choices": positive_int, "perplexity_docs_n": positive_int,
                            "perplexity_tokens": positive_int, "seed": non_negative_int,
                            "recall_depths": optional(list_of(depth))})
EXPERIMENT = register(Experiment(
    "accuracy", "Accuracy across KV budgets", run_point, timed=False, trained_only=True, order=order,
    workload={"task": text, "batch_size": positive_int, "protocol": one_of(*PROTOCOLS),
              "limit": optional(positive_int), "ruler": optional(RULER), "offline_tasks": optional(OFFLINE_TASKS),
              "prefill_store_gb": optional(positive_number)},
    required=("task",),
    lead=chapter.lead, findings=(4,), sizes=sizes, error_rate=ACCURACY.statement(), held_gib=held_gib))
