"""An untimed experiment's units in one process of every thread against one-thread worker processes
(kvlib.study.executor.Processes, what `kvlib study` uses for accuracy and retention): the wall time of the same units,
side by side in one run, and whether the rows are the same.

The units: the embedded profile's accuracy points of two paper tasks under the one-pass protocol and of RULER's task
under the deployed one (its recorded prefills shared within a worker), the first repeat of each; each side computes
them cold (a fresh process, models loaded in its time), the order alternating over ROUNDS (one: ~15 min).

    python benchmarks/bench_untimed_workers.py

Writes benchmarks/results/untimed_workers.json.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor

from smoke import SMOKE, results_path, sized

ROUNDS = sized(1, 1)
TASKS = ("copa", "piqa", "niah_single_1")
RUN_COLUMNS = {"unit_compute_s", "load_avg_1m", "others_cpu_s", "others_cpu_share", "steal_s", "steal_share",
               "disturbed", "finished_at", "cpu_threads", "unit_workers", "attempts"}


def units():
    from kvlib.study.run import load_profile

    profile = load_profile("smoke" if SMOKE else "embedded")
    points = [p for p in profile.points("accuracy") if p.values["task"] in TASKS or SMOKE]
    return [(p, 0) for p in points]


def serial(units_, meta):
    """Every unit in one fresh process of every thread, as `kvlib study --workers 1` computes them."""
    import torch

    from kvlib.study.executor import Serial

    torch.set_num_threads(os.cpu_count() or 1)
    out = []
    Serial().run(units_, meta, lambda p, r, rows: out.append(rows))
    return out


def side(name: str, workers: int) -> tuple[float, list]:
    from kvlib.study.executor import Processes, run_metadata
    from kvlib.study.experiments.accuracy import order

    todo, meta = units(), run_metadata("embedded")
    start = time.perf_counter()
    if workers == 1:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            frames = pool.submit(serial, todo, meta).result()
    else:
        frames = []
        Processes(workers, affinity=order).run(todo, meta, lambda p, r, rows: frames.append(rows))
    return time.perf_counter() - start, frames


def same_rows(a: list, b: list) -> bool:
    import pandas as pd

    def table(frames):
        frame = pd.concat(frames, ignore_index=True)
        keep = sorted(c for c in frame.columns if c not in RUN_COLUMNS)
        return frame[keep].astype(str).sort_values(keep).reset_index(drop=True)

    return table(a).equals(table(b))


def main() -> None:
    workers = max(2, os.cpu_count() or 1)
    walls = {"one process": [], f"{workers} workers": []}
    rows = {}
    for r in range(ROUNDS):
        for name, n in (list(zip(walls, (1, workers))))[:: 1 if r % 2 == 0 else -1]:
            wall, rows[name] = side(name, n)
            walls[name].append(wall)
            print(f"round {r}: {name} {wall:.1f} s", flush=True)
    one, many = (min(w) for w in walls.values())
    figures = {"units": len(units()), "tasks": list(TASKS), "cpus": os.cpu_count(), "walls_s": walls,
               "ratio_workers_to_one": many / one, "same_rows": same_rows(*rows.values())}
    print(json.dumps(figures, indent=1))
    path = results_path("untimed_workers.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
