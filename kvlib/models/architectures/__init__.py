"""The paper's models as shapes: their published configurations, shipped as JSON, to be built with random weights.

The systems figures (TTFT and its OOM boundary, batch scaling, decode length, memory by component) depend on a model's
shape, not on its weights, so the paper's architectures can be measured on machines that never reach a model hub.
Each `<name>.json` here is the model's published `config.json` (`_hub_id` names where its trained weights live).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvlib.errors import UserError
from kvlib.paths import cache_dir

FOLDER = Path(__file__).parent


def names() -> list[str]:
    return sorted(p.stem for p in FOLDER.glob("*.json"))


def is_architecture(name: str) -> bool:
    return (FOLDER / f"{name}.json").is_file()


def published_config(name: str) -> dict:
    """The architecture's config.json as published (keys starting with `_` are ours: where it came from)."""
    if not is_architecture(name):
        raise UserError(f"unknown architecture {name!r}; named architectures: {names()}")
    return json.loads((FOLDER / f"{name}.json").read_text())


def hub_id(name: str) -> str:
    return published_config(name)["_hub_id"]


def architecture_config(name: str):
    """A transformers config of the architecture, every dimension as published."""
    from transformers import AutoConfig

    raw = {k: v for k, v in published_config(name).items() if not k.startswith("_")}
    return AutoConfig.for_model(raw.pop("model_type"), **raw)


def config_folder(name: str) -> Path:
    """A local model folder holding only the architecture's config.json, for loaders that read a folder (vLLM with
    load_format="dummy")."""
    folder = cache_dir() / "architectures" / name
    target = folder / "config.json"
    text = json.dumps({k: v for k, v in published_config(name).items() if not k.startswith("_")}, indent=2)
    if not target.exists() or target.read_text() != text:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".config.json.{os.getpid()}"
        tmp.write_text(text)
        tmp.replace(target)
    return folder
