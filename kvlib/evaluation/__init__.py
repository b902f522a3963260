"""Accuracy through lm-eval (the `kvlib` model, offline tasks) and the multi-turn retention test."""

# lm-eval's own models must be imported before ours is registered, or its built-in `hf` model disappears
import lm_eval.models  # noqa: F401

from kvlib.evaluation.lm import KVLibLM  # noqa: F401  (registers the `kvlib` model)
