"""Rows of the accuracy experiment on the paper's six tasks, with known losses: what the finding 4, verdict,
provenance and model-size tests read."""

import numpy as np
import pandas as pd

from kvlib.report.accuracy.paper_tasks import PAPER_TASKS

CHANCE = {"piqa": 0.5, "copa": 0.5, "winogrande": 0.5, "hellaswag": 0.25, "openbookqa": 0.25, "boolq": 0.62}
NAN, INF = float("nan"), float("inf")
# (policy, budget, budget_rule, alpha): share of a task's items lost (from those the full cache had right), or
# "chance": answers drawn at the task's chance rate
POINTS = {("h2o", 0.5, "flexgen", NAN): 0.0, ("infinigen", 0.5, NAN, 5.0): 0.0, ("h2o", 0.3, "flexgen", NAN): 0.02,
          ("infinigen", 0.3, NAN, 5.0): 0.01, ("h2o", 0.1, "flexgen", NAN): 0.15, ("infinigen", 0.1, NAN, 5.0): 0.06,
          ("h2o", 0.04, "flexgen", NAN): "chance", ("infinigen", 0.04, NAN, 5.0): "chance",
          ("h2o", 0.1, "seen", NAN): 0.4, ("h2o", 0.5, "seen", NAN): 0.3, ("infinigen", 0.2, NAN, INF): 0.05}
SHARES = {("h2o", 0.1, "flexgen", NAN): 0.2}  # kv_share_attended measured (else the budget)


def paper_frame(items=300, full_share=0.8, points=None, tasks=PAPER_TASKS, sizes=None, full_shares=None, seed=0,
                model="smollm2-135m", protocol="one_pass", shares=None):
    """Rows of the accuracy experiment for the paper's tasks: one per item per grid point. A point's loss is exact
    (the first round(share x items) items the full cache had right, lost), so a known drop is the drop."""
    rng = np.random.default_rng(seed)
    points = POINTS if points is None else points
    rows = []
    for task in tasks:
        n, share = (sizes or {}).get(task, items), (full_shares or {}).get(task, full_share)
        full = np.zeros(n)
        full[rng.permutation(n)[:round(share * n)]] = 1.0
        base = {"model": model, "task": task, "protocol": protocol, "chance": CHANCE[task], "role": "confirmatory"}
        rows += [{**base, "policy": "full", "budget": NAN, "budget_rule": NAN, "alpha": NAN, "doc_id": i,
                  "correct": full[i], "correct_norm": NAN, "kv_share_attended": 1.0} for i in range(n)]
        for (policy, budget, rule, alpha), loss in points.items():
            if loss == "chance":
                scores = (rng.random(n) < CHANCE[task]).astype(float)
            else:
                scores = full.copy()
                scores[np.flatnonzero(full)[:round(loss * n)]] = 0.0
            kept = (SHARES | (shares or {})).get((policy, budget, rule, alpha), budget)
            rows += [{**base, "policy": policy, "budget": budget, "budget_rule": rule, "alpha": alpha, "doc_id": i,
                      "correct": scores[i], "correct_norm": NAN, "kv_share_attended": kept} for i in range(n)]
    return pd.DataFrame(rows)
