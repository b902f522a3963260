"""Which model and which machine a page's rows come from, in a few words: every figure drawn from result rows says it
in its title (a reader who meets one figure out of context can tell what produced it), and every chapter's lead in
one sentence (kvlib.report.opening). Read from the rows only: the `model` column (by the name README gives an
embedded model, kvlib.models.embedded), `machine_cpu` and `machine_gpu` (kvlib.study.machine), and the device the rows
ran on (`device`, else `device_name`); a column that is absent says nothing, never a guess."""

from __future__ import annotations

import pandas as pd

ABSENT = {"", "null", "none", "nan", "<na>"}  # how a missing value can come back from the rows' files
SHOWN = 3  # of several models or machines, this many are named


def _values(frames: tuple[pd.DataFrame, ...], column: str) -> list[str]:
    """The column's distinct recorded values over the frames, in order of first appearance."""
    seen: dict[str, None] = {}
    for df in frames:
        if column in df:
            for value in df[column].dropna().astype(str).unique():
                if value.strip().lower() not in ABSENT:
                    seen.setdefault(value.strip(), None)
    return list(seen)


def model_name(model: str) -> str:
    """An embedded model by the name README gives it (its hub name, e.g. SmolLM2-135M-Instruct); any other as the
    rows have it."""
    from kvlib.models.embedded import EMBEDDED_MODELS

    return EMBEDDED_MODELS[model].hub_id.split("/")[-1] if model in EMBEDDED_MODELS else model


def _several(names: list[str], what: str) -> str:
    if len(names) == 1:
        return names[0]
    listed = ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
    return f"several {what} ({listed})"


def machines(*frames: pd.DataFrame) -> list[str]:
    """Each machine the rows name: its CPU, with its GPU where one is recorded."""
    out: dict[str, None] = {}
    for df in frames:
        if "machine_cpu" not in df:
            continue
        gpu = df["machine_gpu"] if "machine_gpu" in df else pd.Series(None, index=df.index, dtype=object)
        for cpu, card in zip(df["machine_cpu"], gpu):
            cpu, card = (None if pd.isna(v) or str(v).strip().lower() in ABSENT else str(v).strip() for v in (cpu, card))
            if cpu is not None or card is not None:
                out.setdefault(" with ".join(v for v in (cpu, card) if v is not None), None)
    return list(out)


def models(*frames: pd.DataFrame) -> str:
    """The model(s) the rows come from, by the names README gives them ("" where they record none)."""
    names = [model_name(m) for m in _values(frames, "model")]
    return _several(names, "models") if names else ""


def provenance(*frames: pd.DataFrame) -> str:
    """The model(s) and the machine(s) the rows come from, e.g. "SmolLM2-135M-Instruct on Intel(R) Xeon(R) Processor
    (device cpu)"; "several models (...)" where the rows hold more than one; "" where they record neither."""
    model = models(*frames)
    named = machines(*frames)
    devices = [d for d in _values(frames, "device") or _values(frames, "device_name")
               if not any(d in m for m in named)]  # a GPU already named as the machine's is not said twice
    parts = [model] if model else []
    if named:
        parts.append("on " + _several(named, "machines"))
    if devices:
        parts.append(f"(device {', '.join(devices)})" if named else f"on device {', '.join(devices)}")
    return " ".join(parts)


def sentence(*frames: pd.DataFrame) -> str:
    """The chapter lead's sentence naming where its rows come from ("" where they record neither)."""
    text = provenance(*frames)
    if not text:
        return ""
    return f"Measured {text}." if text.startswith("on ") else f"Measured with {text}."


def titled(title: str, *frames: pd.DataFrame) -> str:
    """A figure's title with the rows' model and machine on a line of its own below it."""
    text = provenance(*frames)
    return f"{title}\n{text}" if title and text else title or text


def suptitle(fig, *frames: pd.DataFrame, title: str = "") -> None:
    """A figure of several panels: `title` and the rows' model and machine above them (nothing where neither)."""
    text = titled(title, *frames)
    if text:
        fig.suptitle(text)
