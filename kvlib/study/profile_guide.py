"""How to write a profile: every key a profile may hold, its type, its default and what it means, generated from the
schema that checks profiles (kvlib.study.schema: the keys and their types), the experiments' code (a workload value's
default is what the experiment reads when the profile leaves it out) and the runners' dataclasses (a setting's type,
default and comment), so that the guide says what the code accepts. The meanings are written here, one line a key:
a key the schema gains without one fails tests/study/test_profile_guide.py."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import tokenize
from pathlib import Path

from kvlib.report.gate import GATE
from kvlib.report.stats import ALPHA, repeats_needed
from kvlib.settings import field_default
from kvlib.study import schema
from kvlib.study.experiments import REGISTRY, common

PROFILE = {
    "model": "the model every experiment runs (a name of `kvlib.models`' registry, e.g. smollm2-135m)",
    "description": "what the profile is for, shown nowhere else but kept with it",
    "device": "where the model runs (cpu, cuda, ...); default: the machine's accelerator, else the CPU",
    "device_capacity_gb": "the device memory a runner may use, in GB; default: the device's own (none on a CPU). "
                          "A configured capacity places the OOM boundaries on a machine that has no separate device",
    "weights": "pretrained (default) or random weights of the model's shape, for the paper's shapes without a download",
    "validity_gate": f"the full cache's least score for a task to be compared on (default {GATE:g}): a task the full "
                     "cache fails says nothing about a policy",
    "policy_settings": "settings per runner for every experiment (`runner: {setting: value}`): the settings below",
    "experiments": "the experiments to run, each a mapping of the keys below; one left out is not run",
    "toy": "values laid over the profile for `kvlib study --toy` (the same code paths at a toy size)",
}
EXPERIMENT = {
    "policies": "the runners: `all` (every kvlib policy) or a list of registered names (`kvlib policies`)",
    "grid": "axes: each key a list of values; the points are their product, for every runner",
    "fixed": "values every point of the experiment shares",
    "repeats": (f"how often each point runs, in rounds (default 1); the by-round test rejects from "
                f"{repeats_needed(ALPHA, paired=True)} rounds at {ALPHA:.0%}, and a finding settled by Holm needs more "
                "(methods: the table of rounds)"),
    "model": "this experiment's model instead of the profile's",
    "device_capacity_gb": "this experiment's device capacity instead of the profile's",
    "exploratory": "`policies` and `fixed` of runners read but not tested (no verdict rests on them)",
    "arms": ("a list of other grids, each `policies`, `grid`, `fixed` (laid over the experiment's), `role` "
             "(confirmatory or exploratory) and optionally `model`: e.g. the paper's six tasks under one_pass"),
}
WORKLOAD = {
    "text_source": "where prompts come from: `{kind: hf, path: ..., field: ...}`; default: the CPython docs offline",
    "calibration_source": "text for policies that calibrate offline (InfiniGen's skew, DuoAttention's heads)",
    "chunk_size": "tokens a chunked prefill computes at a time",
    "prefill": "full (the L x L scores), fused (SDPA) or chunked; default: the runner's preferred mode",
    "seed": "the seed of the prompts' sampling and the arrival trace",
    "prompt_tokens": "prompt length in tokens",
    "max_new_tokens": "tokens decoded after the prompt",
    "batch_size": "requests run together",
    "min_prompt_tokens": "shortest prompt of a batch or trace (lengths drawn uniformly between min and max)",
    "max_prompt_tokens": "longest prompt of a batch or trace",
    "output_tokens": "tokens decoded, the end-of-sequence token ignored",
    "num_requests": "requests in the serving trace",
    "min_output_tokens": "shortest output of the trace's requests",
    "max_output_tokens": "longest output of the trace's requests",
    "request_rate": "arrivals per second (a Poisson process); or give `rate_multiple`",
    "rate_multiple": "arrivals as a multiple of this machine's service rate (paged serving the whole trace at once), "
                     "so that a grid asks as much of a fast machine as of a slow one",
    "burstiness": "the arrivals' gamma shape (1: Poisson; below 1: burstier)",
    "slo_ttft_s": "the TTFT a request must meet to count toward goodput, in seconds",
    "slo_tpot_s": "the time per output token a request must meet to count toward goodput, in seconds",
    "task": "an lm-eval task name, or one of kvlib's offline tasks (kvlib_recall, niah_single_1, ...)",
    "protocol": ("deployed (the question prefilled with the context) or strict (the question decoded after it); for "
                 "accuracy also one_pass (each log-likelihood request one masked pass, as the official H2O and "
                 "InfiniGen harnesses score lm-eval: kvlib.evaluation.one_pass)"),
    "limit": "the first N items of the task (paired across runners); default: every item",
    "ruler": "RULER's `max_seq_lengths`, `items` and `max_gen_toks` (kvlib.evaluation.ruler)",
    "offline_tasks": "the offline tasks' sizes: recall lengths, items, choices, depths; perplexity documents, tokens",
    "prefill_store_gb": "memory for the recorded dense prefills that every policy adopts instead of its own; default: "
                        "a quarter of the machine's memory (the one-pass protocol records none)",
    "query_turns": "the turns after the fact at which retention asks for it",
    "buckets": "conversation lengths in tokens, [low, high] each",
    "per_bucket": "conversations per bucket",
    "conversations": "where conversations come from (a source mapping); default: generated offline",
    "lockstep": "conversations run together in one batch",
    "answer_tokens": "tokens decoded for an answer; default: the task's own",
}
# the settings several runners share, where a runner's own source says nothing beside the field
SETTINGS = {
    "budget": "the share of the tokens kept (of those seen so far, or of the prompt under `budget_rule: flexgen`)",
    "budget_tokens": "a token count kept instead of `budget`'s share (None: the share)",
    "block_size": "tokens a block of the KV pool holds",
    "chunk_scoring": "how a chunked prefill scores the prompt: accumulate (every later query's attention counts)",
    "budget_rule": "seen (a share of the tokens seen, growing) or flexgen (heavy = recent = ratio x prompt, fixed)",
    "calibration_tokens": "tokens of calibration text for the offline calibration",
    "percent": "FlexGen's placement, six numbers: weights on device and host %, KV on device and host %, "
               "activations on device and host % (the rest on disk)",
    "compress_cache": "the cache in FlexGen's 4-bit groups of 64",
    "skew": "InfiniGen's offline skewing of the query and key projections, which its speculation reads",
    "prefix_caching": "vLLM's automatic prefix caching",
}


def _defaults(experiment: str) -> dict[str, str]:
    """`values.get("key", default)` in the experiment's module and the shared one: the default of each key it reads."""
    run_point, found = REGISTRY[experiment].run_point, {}
    for path, names in ((run_point.__code__.co_filename, run_point.__globals__), (common.__file__, vars(common))):
        for node in ast.walk(ast.parse(Path(path).read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)):
                default = node.args[1]  # a named constant by its value, as a reader writes it in a profile
                shown = repr(names[default.id]) if isinstance(default, ast.Name) and \
                    isinstance(names.get(default.id), str | int | float) else ast.unparse(default)
                found.setdefault(node.args[0].value, shown)
    return found


def _required(experiment: str) -> set[str]:
    return {k for k in REGISTRY[experiment].required if isinstance(k, str)}


def workload_table(experiment: str) -> str:
    keys = {**schema.COMMON, **REGISTRY[experiment].workload}
    meanings = {**WORKLOAD, **REGISTRY[experiment].meanings}
    defaults = _defaults(experiment)
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, check in keys.items():
        default = "required" if key in _required(experiment) else defaults.get(key, "none")
        lines.append(f"| `{key}` | {check.kind} | {default if default == 'required' else f'`{default}`'} "
                     f"| {meanings[key]} |")
    return "\n".join(lines)


def _comments(cls) -> dict[str, str]:
    """Each field's trailing comment in the class's source (the why a setting has)."""
    out = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass.__module__.split(".")[0] != "kvlib":
            continue
        tokens = list(tokenize.generate_tokens(io.StringIO(inspect.getsource(klass)).readline))
        for i, tok in enumerate(tokens):
            if tok.type == tokenize.COMMENT and i >= 1:
                line = tokens[i - 1].line.strip()
                name = line.split(":")[0].strip()
                if name.isidentifier() and ":" in line and tokens[i - 1].start[0] == tok.start[0]:
                    out[name] = _continued(tokens, i)
    return out


def _continued(tokens: list, i: int) -> str:
    """The trailing comment at tokens[i], with the comment-only lines after it that continue it: while a parenthesis
    it opened is still open (a comment that goes on into the next line, as duo's `window`'s does)."""
    text, line = tokens[i].string.lstrip("# ").strip(), tokens[i].start[0]
    following = (t for t in tokens[i + 1:] if t.type not in (tokenize.NL, tokenize.NEWLINE))
    for tok in following:
        if text.count("(") <= text.count(")") or tok.type != tokenize.COMMENT or tok.start[0] != line + 1:
            break
        text, line = f"{text} {tok.string.lstrip('# ').strip()}", tok.start[0]
    return text


def settings_table(runner: str) -> str:
    from kvlib.study.runners import runner_class

    cls = runner_class(runner)
    meaning = {**SETTINGS, **_comments(cls)}
    fidelity = getattr(cls, "fidelity", None)
    for rule in fidelity.rules if fidelity else ():  # the fidelity table's row for a setting, where it has one
        if rule.setting:
            official = f"the official code: {rule.official}" + (" (kvlib departs: see fidelity)" if rule.differs else "")
            meaning[rule.setting] = "; ".join(filter(None, [meaning.get(rule.setting), f"{rule.rule}; {official}"]))
    rows = []
    for f in dataclasses.fields(cls):
        default = field_default(f)
        shown = "required" if default is dataclasses.MISSING else f"`{default!r}`"
        rows.append(f"| `{f.name}` | `{f.type}` | {shown} | {meaning.get(f.name, '')} |")
    return "\n".join(["| setting | type | default | why / meaning |", "|---|---|---|---|", *rows]) if rows else \
        "(no settings)"


def markdown() -> str:
    from kvlib.study.runners import runners

    out = ["# Writing a profile", "",
           ("A profile is a YAML file: `params/<name>.yaml`, or a path of your own (`kvlib study --profile "
           "path/to/mine.yaml`; its results go to `results/<file name>/`). `kvlib study` checks every key before "
           "anything runs and reports every problem at once, each at its key path. This page is generated from that "
           "check (`kvlib.study.schema`), the experiments' code and the runners' settings "
           "(`kvlib.study.profile_guide`): it lists what the code accepts. `params/smoke.yaml` is the smallest "
           "example, `params/embedded.yaml` the book's."), "", "## The profile", "",
           "| key | meaning |", "|---|---|", *[f"| `{k}` | {v} |" for k, v in PROFILE.items()], "",
           "## An experiment", "", "| key | meaning |", "|---|---|",
           *[f"| `{k}` | {v} |" for k, v in EXPERIMENT.items()], "",
           ("A key of `grid` or `fixed` is either the experiment's workload value (below) or a runner's setting "
            "(further below), which applies to the runners that have it."), ""]
    for experiment in REGISTRY:
        out += [f"### {experiment}", "", workload_table(experiment), ""]
    out += ["## Runners' settings", "",
            ("Per runner in `policy_settings`, or in an experiment's `grid` / `fixed` (as `kvlib run --set key=value`); "
             "a setting that departs from the policy's official code is a row of the methods page's fidelity table."),
            ""]
    for runner in sorted(runners()):
        out += [f"### {runner}", "", settings_table(runner), ""]
    return "\n".join(out)
