"""Accuracy per task and KV budget through lm-eval (paper Fig. 7): one row per item."""

from kvlib.evaluation import KVLibLM
from kvlib.evaluation.ruler import RULER_TASKS, evaluate_ruler
from kvlib.evaluation.tasks import evaluate, write_offline_tasks
from kvlib.models.workloads import calibration_prompt
from kvlib.study.experiments.common import model_of

TIMED = False  # what it measures is a score, the same under load: never measured again


def run_point(point) -> list[dict]:
    v = point.values
    loaded = model_of(point)
    protocol = v.get("protocol", "deployed")
    lm = KVLibLM(policy=point.runner, loaded=loaded, batch_size=v.get("batch_size", 8), protocol=protocol,
                 calibration=calibration_prompt(loaded, v.get("calibration_source")), **point.settings)
    if v["task"] in RULER_TASKS:  # lm-eval's RULER: items sized per length (kvlib.evaluation.ruler)
        rows = evaluate_ruler(lm, v["task"], loaded.tokenizer.name_or_path, **(v.get("ruler") or {}))
        return [{**row, "protocol": protocol} for row in rows]
    offline = v.get("offline_tasks")
    folder = write_offline_tasks(loaded.tokenizer, **offline) if offline else None
    rows = evaluate(lm, [v["task"]], include_path=folder, limit=v.get("limit"))
    # a scored continuation always comes from decode steps (kvlib.evaluation.lm): strict, whatever the point says
    return [{**row, "kv_share_attended": lm.kv_share_attended, "protocol": "strict"} for row in rows]
