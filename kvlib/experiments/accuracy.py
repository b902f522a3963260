"""Accuracy per task and KV budget through lm-eval (paper Fig. 7): one row per item."""

from kvlib.evaluation import KVLibLM
from kvlib.evaluation.ruler import RULER_TASKS, evaluate_ruler
from kvlib.evaluation.tasks import evaluate, write_offline_tasks
from kvlib.experiments.common import model_of, settings_of, weights_of
from kvlib.random_weights import check_experiment


def run_point(point: dict) -> list[dict]:
    check_experiment("accuracy", weights_of(point))
    loaded = model_of(point)
    lm = KVLibLM(policy=point["policy"], loaded=loaded, batch_size=point.get("batch_size", 8), **settings_of(point))
    if point["task"] in RULER_TASKS:  # lm-eval's RULER: items sized per length (kvlib.evaluation.ruler)
        return evaluate_ruler(lm, point["task"], loaded.tokenizer.name_or_path, **(point.get("ruler") or {}))
    offline = point.get("offline_tasks")
    folder = write_offline_tasks(loaded.tokenizer, **offline) if offline else None
    rows = evaluate(lm, [point["task"]], include_path=folder, limit=point.get("limit"))
    return [{**row, "kv_share_attended": lm.kv_share_attended} for row in rows]
