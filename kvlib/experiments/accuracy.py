"""Accuracy per task and KV budget through lm-eval (paper Fig. 7): one row per item."""

from kvlib.evaluation import KVLibLM
from kvlib.evaluation.tasks import evaluate, write_offline_tasks
from kvlib.experiments.common import model, settings_of


def run_point(point: dict) -> list[dict]:
    loaded = model(point["model"], point.get("device"))
    lm = KVLibLM(policy=point["policy"], loaded=loaded, batch_size=point.get("batch_size", 8), **settings_of(point))
    offline = point.get("offline_tasks")
    folder = write_offline_tasks(loaded.tokenizer, **offline) if offline else None
    rows = evaluate(lm, [point["task"]], include_path=folder, limit=point.get("limit"))
    return [{**row, "kv_share_attended": lm.kv_share_attended} for row in rows]
