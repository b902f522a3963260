"""The paper's GPU settings, projected: Llama-3.1-8B in bf16 at its published shape, on one H100 SXM over PCIe 5 and
on GH200 over NVLink-C2C, each policy's decode step and memory by tier at the paper's batch-scaling and decode-length
settings. Every figure here is projected, never measured: `*_bound_projected` from the roofline (kvlib.projection.
bound: a ceiling on throughput), `*_projected` from aiconfigurator-core's measured kernels (kvlib.projection.
gpu_kernels: an estimate), each row naming its hardware spec and kernel data version.

What each policy's step does at the shape (per row and decode step, mean over the run: step work is linear in the
tokens held, so the mean step is the step at the mean length):
- `full`, `paged` (vLLM-like, dense): every layer reads every held token.
- `h2o` under the paper's FlexGen rule (kvlib.policies.h2o budget_rule "flexgen"): heavy = recent = int(0.3 x
  prompt), fixed during decode, and the new token: ~0.6 of the prompt attended, the attention probabilities read back
  (fp32) to fold into its scores.
- `infinigen`: the first `dense_layers` layers dense on the device; each other layer speculates over every held
  token's partial key (partial_ratio of the head's dimensions) and fetches `fetch_share` of the held tokens from the
  host over the link (a copy for keys, one for values), attending those and the new token. The share is taken from
  measured runs (`measured_fetch_share`) and at the paper's 0.3 cap.
These four are the chapter's. `for_workload` (`kvlib choose --hardware`) adds every other runner of a profile's
systems experiments, each step read from its policy's settings and methods (kvlib.projection.policy_step: a Runner
with `settings`), and keeps a row saying why where a runner is not projected.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvlib.models.pass_shape import PassShape, add
from kvlib.policies.h2o import heavy_recent
from kvlib.projection.policy_step import NotProjected

MODEL = "llama-3.1-8b"
DTYPE_BYTES = 2  # bf16, as the paper ran it
HARDWARE = ("h100_sxm", "gh200")
# The paper's batch scaling: "batch sizes from 16 to 96 ... lengths uniformly distributed 1K-10K tokens"; its output
# length is not stated in the text: 512, as params/paper.yaml's batch_scaling sets max_new_tokens.
BATCHES = (16, 32, 48, 64, 80, 96)
PROMPT_RANGE = (1024, 10240)
BATCH_OUTPUT = 512
# Its decode length: "from 512 to 8,192 tokens, using a fixed 10K-token input prompt"; one sequence (its ~8 tokens/s
# and 16 minutes at 8,192 outputs agree only at batch 1).
DECODE_PROMPT = 10240
OUTPUTS = (512, 1024, 2048, 4096, 8192)
DECODE_BATCH = 1
H2O_RATIO = 0.3  # the paper's heavy-hitter ratio on FlexGen
INFINIGEN_CAP = 0.3  # the paper's InfiniGen budget
INFINIGEN_DENSE_LAYERS = 2
INFINIGEN_PARTIAL_RATIO = 0.2
SCORE_BYTES = 4  # fp32 probabilities a scorer reads back per attended token (kvlib.memory.work)


@dataclass(frozen=True)
class Runner:
    name: str
    policy: str
    fetch_share: float | None = None  # InfiniGen: the share of held tokens a sparse layer fetches
    share_source: str = ""
    h2o_ratio: float = H2O_RATIO  # H2O: heavy = recent = int(ratio x prompt), FlexGen's rule
    # a profile's runner: its policy's settings (key, value) pairs, its step read from the policy itself
    # (kvlib.projection.policy_step); None: the paper's rule above for its policy
    settings: tuple | None = None
    reason: str = ""  # why it is not projected, where it is not


@dataclass(frozen=True)
class Workload:
    setting: str  # "batch scaling" or "decode length"
    batch: int
    prompt: int  # mean prompt tokens per row
    output: int

    @property
    def mean_held(self) -> float:
        """Tokens a row holds at its mean decode step, the new one included."""
        return self.prompt + (self.output + 1) / 2

    @property
    def final_held(self) -> int:
        return self.prompt + self.output


def workloads() -> list[Workload]:
    mean_prompt = sum(PROMPT_RANGE) // 2
    return ([Workload("batch scaling", b, mean_prompt, BATCH_OUTPUT) for b in BATCHES]
            + [Workload("decode length", DECODE_BATCH, DECODE_PROMPT, n) for n in OUTPUTS])


def partial_dims(shape: PassShape) -> int:
    # the fewest columns the official rule keeps (the union of the query's int(r x D) and the key's, as
    # kvlib.policies.infinigen_skew cuts it, is wider where they differ): speculation's reads at least
    return max(1, int(INFINIGEN_PARTIAL_RATIO * shape.head_dim))


def h2o_attended(prompt: int, held: float, ratio: float = H2O_RATIO) -> float:
    kept, _ = heavy_recent("flexgen", ratio, None, 0.5, int(held), prompt)
    return kept + 1  # the kept entries and the new token beside them


@dataclass(frozen=True)
class StepWork:
    work: dict  # one decode step's counts (kvlib.memory.work.QUANTITIES)
    kv_length: float  # what the sparse layers' attention attends, per row
    full_layers_share: float  # layers that attend every held token instead
    kernels: bool = True  # aiconfigurator's kernels describe its attention
    note: str = ""


def step_work(shape: PassShape, hidden_size: int, runner: Runner, load: Workload) -> StepWork:
    """One mean decode step's work at the shape, counted as kvlib's engine counts it."""
    b, held = load.batch, load.mean_held
    if runner.settings is not None:
        got = policy_rule(shape, runner, load)
        return StepWork(with_zeros(got.work), got.kv_length, got.full_layers_share, got.kernels, got.note)
    if runner.policy == "h2o":
        attended = h2o_attended(load.prompt, held, runner.h2o_ratio)
        work = shape.decode_step(b, attended)
        work["select_read_bytes"] = b * shape.num_layers * shape.num_kv_heads * attended * SCORE_BYTES
        return StepWork(with_zeros(work), attended, 0.0)
    if runner.policy != "infinigen":
        return StepWork(with_zeros(shape.decode_step(b, held)), held, 0.0)
    dense = INFINIGEN_DENSE_LAYERS
    sparse, r = shape.num_layers - dense, partial_dims(shape)
    fetched = runner.fetch_share * held
    group = shape.num_attention_heads // shape.num_kv_heads
    read = b * shape.num_kv_heads * (dense * held + sparse * (fetched + 1))
    q_width = shape.num_attention_heads * shape.head_dim
    work = add(shape.pass_work(b, 1), shape.attention_work(read, read * group), {
        "select_read_bytes": sparse * b * held * shape.num_kv_heads * r * shape.dtype_bytes,
        "select_flops": sparse * (2 * b * (hidden_size * q_width + q_width * r) + 2 * b * held
                                  * shape.num_attention_heads * r),
        "host_to_device_bytes": sparse * b * shape.num_kv_heads * fetched * shape.kv_token_bytes,
        "host_to_device_transfers": 2 * sparse})
    return StepWork(with_zeros(work), fetched + 1, dense / shape.num_layers)


def policy_rule(shape: PassShape, runner: Runner, load: Workload):
    """A profile runner's step and memory, read from its policy (kvlib.projection.policy_step.rule)."""
    from kvlib.projection import policy_step

    policy = _policy(runner.policy, runner.settings, shape)
    return policy_step.rule(policy, shape, load.batch, load.prompt, load.output)


_POLICIES: dict = {}


def _policy(name: str, settings: tuple, shape: PassShape):
    from kvlib.projection import policy_step

    key = (name, repr(settings), shape)
    if key not in _POLICIES:
        _POLICIES[key] = policy_step.policy_at(name, dict(settings), shape)
    return _POLICIES[key]


def with_zeros(work: dict) -> dict:
    from kvlib.memory.work import QUANTITIES

    return {q: work.get(q, 0) for q in QUANTITIES}


def memory_by_tier(shape: PassShape, config, runner: Runner, load: Workload) -> dict:
    """Bytes held at the run's end (its peak): device weights + KV, host KV."""
    weights = shape.weight_bytes + (0 if config.tie_word_embeddings else config.vocab_size * shape.row_bytes)
    if runner.settings is not None:
        got = policy_rule(shape, runner, load)
        device, host = weights * got.device_weight_share + got.device_kv_bytes, weights * (1 - got.device_weight_share)
        return {"device_weights_gb_projected": weights * got.device_weight_share / 1e9,
                "device_kv_gb_projected": got.device_kv_bytes / 1e9, "device_gb_projected": device / 1e9,
                "host_gb_projected": (host + got.host_kv_bytes) / 1e9}
    per_token = shape.num_kv_heads * shape.kv_token_bytes  # one layer's
    held = load.batch * load.final_held
    device_kv, host_kv = held * shape.num_layers * per_token, 0
    if runner.policy == "h2o":
        kept = h2o_attended(load.prompt, load.final_held, runner.h2o_ratio) - 1  # its slots; the new token is attended beside them
        device_kv = load.batch * kept * shape.num_layers * per_token
    elif runner.policy == "infinigen":
        dense, r = INFINIGEN_DENSE_LAYERS, partial_dims(shape)
        sparse = shape.num_layers - dense
        device_kv = held * (dense * per_token + sparse * shape.num_kv_heads * r * shape.dtype_bytes)
        host_kv = held * sparse * per_token
    return {"device_weights_gb_projected": weights / 1e9, "device_kv_gb_projected": device_kv / 1e9,
            "device_gb_projected": (weights + device_kv) / 1e9, "host_gb_projected": host_kv / 1e9}


def measured_fetch_share(profile: str = "embedded") -> tuple[float | None, str]:
    """InfiniGen's fetched share measured in `profile`'s runs and where it is from (see measured)."""
    return measured(profile)[:2]


def measured(profile: str) -> tuple[float | None, str, str | None]:
    """InfiniGen's fetched share in its sparse layers, mean over `profile`'s runs that decoded a static batch with it
    (the paper's setting: batch scaling's and decode length's runs in the book's profiles; a TTFT run decodes no step,
    a serving run's batch changes as requests come and go), each row's kv_share_attended_per_layer past its dense
    layers, with where it is from:
    the model and prompt lengths of the rows, since a share measured on a small model's short prompts is not the
    paper's, and a runner's name that says the same; (None, why, None) where there are none."""
    import numpy as np

    shares, groups = [], {}
    for experiment, rows in _infinigen_rows(profile):
        for _, row in rows.iterrows():
            layers = row.get("stat_kv_share_attended_per_layer")
            if isinstance(layers, str):  # a published book's rows keep lists as JSON
                layers = json.loads(layers)
            if layers is None or not len(layers):
                continue
            share = float(np.mean(layers[int(row.get("dense_layers", INFINIGEN_DENSE_LAYERS)):]))
            shares.append(share)
            groups.setdefault((experiment, str(row.get("model", "an unnamed model")), _prompts(row)), []).append(share)
    if not shares:
        return None, f"no InfiniGen run in {profile}'s results decoded a static batch", None
    parts = [f"{model}, {prompts} prompts ({experiment}, {len(got)} runs, {min(got):.2f}-{max(got):.2f})"
             for (experiment, model, prompts), got in groups.items()]
    models = ", ".join(dict.fromkeys(model for _, model, _ in groups))
    lengths = " and ".join(dict.fromkeys(prompts for _, _, prompts in groups))
    name = f"infinigen (share {np.mean(shares):.2f} measured on {models}, {lengths} prompts)"
    return float(np.mean(shares)), f"measured: mean of {len(shares)} InfiniGen runs: {'; '.join(parts)}", name


def _prompts(row) -> str:
    import pandas as pd

    low, high, one = row.get("min_prompt_tokens"), row.get("max_prompt_tokens"), row.get("prompt_tokens")
    if not (pd.isna(low) or pd.isna(high)):
        return f"{int(low):,}-{int(high):,}-token"
    return "unknown-length" if pd.isna(one) else f"{int(one):,}-token"


# what `measured` reads of a run's row: which runs, their per-layer shares, and where those came from
SHARE_COLUMNS = ("policy", "experiment", "decode_steps", "stat_batching", "stat_kv_share_attended_per_layer",
                 "dense_layers", "model", "min_prompt_tokens", "max_prompt_tokens", "prompt_tokens")


def _infinigen_rows(profile: str):
    """(experiment, InfiniGen's runs that decoded a static batch) from where the profile's rows are read: a run's
    folder of parquet files an experiment, or a published book's one file an experiment."""
    import pandas as pd
    import pyarrow.parquet as pq

    from kvlib.paths import read_from

    base = read_from(profile)
    for path in sorted(base.glob("*/*.parquet")):
        columns = pq.read_schema(path).names
        if not {"policy", "experiment", "decode_steps", "stat_batching"} <= set(columns):
            continue  # no run that decoded (an accuracy item's row, a retention question's): its rows are not read
        rows = pd.read_parquet(path, columns=[c for c in SHARE_COLUMNS if c in columns])
        decoded = (rows["policy"] == "infinigen") & (rows["decode_steps"] > 0) & (rows["stat_batching"] == "static")
        yield from rows[decoded].groupby("experiment", sort=False)


def runners(fetch_share: float | None = None, profile: str = "embedded") -> list[Runner]:
    """The projected runners: the dense ones, H2O at the paper's rule, InfiniGen at its measured share (or the share
    given) and at the paper's cap."""
    name = "infinigen (given share)"
    if fetch_share is None:
        fetch_share, source, name = measured(profile)
    else:
        source = "given"
    out = [Runner("full", "full"), Runner("paged", "paged"), Runner("h2o", "h2o")]
    if fetch_share is not None:
        out.append(Runner(name, "infinigen", fetch_share, source))
    return out + [Runner("infinigen (0.3 cap)", "infinigen", INFINIGEN_CAP, "the paper's budget 0.3, the cap")]


def projection(fetch_share: float | None = None, profile: str = "embedded", hardware_names=HARDWARE,
               kernels: bool = True, model: str = MODEL, loads: list[Workload] | None = None,
               runner_list: list[Runner] | None = None):
    """Every runner on every hardware at every paper setting (or the workloads given, of `model`): decode step and
    throughput, bound and aiconfigurator's (serialized and overlapped transfers), memory by tier; one row each, every
    figure labelled projected (`runner_list` in place of the usual runners)."""
    import pandas as pd

    from kvlib import hardware
    from kvlib.models import model_config
    from kvlib.projection import bound, gpu_kernels

    config = model_config(model)
    shape = PassShape.of(config, DTYPE_BYTES)
    kernels = kernels and gpu_kernels.available()
    rows = []
    for name in hardware_names:
        spec = hardware.load(name)
        for runner in runner_list or runners(fetch_share, profile):
            for load in loads or workloads():
                if runner.reason:
                    rows.append(not_projected(name, runner, load, runner.reason, spec))
                    continue
                try:
                    sw = step_work(shape, config.hidden_size, runner, load)
                except NotProjected as why:
                    rows.append(not_projected(name, runner, load, str(why), spec))
                    continue
                times = bound.phase_times(sw.work, spec, "bfloat16")
                bound_s = bound.combine(times, bound.OVERLAPPED)
                row = {"setting": load.setting, "hardware": name, "runner": runner.name, "policy": runner.policy,
                       "batch_size": load.batch, "prompt_tokens": load.prompt, "output_tokens": load.output,
                       "attended_tokens": sw.kv_length, "fetch_share": runner.fetch_share,
                       "fetch_share_source": runner.share_source,
                       "decode_step_ms_bound_projected": 1e3 * bound_s,
                       "decode_tokens_per_s_bound_projected": load.batch / bound_s,
                       "transfer_ms_projected": 1e3 * times["transfer_s"],
                       "decode_minutes_bound_projected": load.output * bound_s / 60,
                       **memory_by_tier(shape, config, runner, load), "hardware_spec": spec.description}
                row["fits_device_projected"] = row["device_gb_projected"] * 1e9 <= spec.device_memory.value
                if sw.note:
                    row["note"] = sw.note
                if kernels and sw.kernels and spec.kernel_system and model in gpu_kernels.MODELS:
                    row |= aiconfigurator_columns(model, spec, sw, load)
                rows.append(row)
    return pd.DataFrame(rows)


def not_projected(hardware_name: str, runner: Runner, load: Workload, reason: str, spec) -> dict:
    """A runner's row without figures: why its step is not projected."""
    return {"setting": load.setting, "hardware": hardware_name, "runner": runner.name, "policy": runner.policy,
            "batch_size": load.batch, "prompt_tokens": load.prompt, "output_tokens": load.output,
            "not_projected": reason, "hardware_spec": spec.description}


def aiconfigurator_columns(model: str, spec, sw: StepWork, load: Workload) -> dict:
    from kvlib.projection import gpu_kernels

    step = gpu_kernels.policy_step(model, spec, sw.work, load.batch, max(1, round(sw.kv_length)),
                                   round(load.mean_held), sw.full_layers_share)
    serialized, overlapped = step["step_serialized_ms"], step["step_overlapped_ms"]
    return {"decode_step_ms_projected": serialized, "decode_step_overlapped_ms_projected": overlapped,
            "decode_tokens_per_s_projected": 1e3 * load.batch / serialized,
            "decode_tokens_per_s_overlapped_projected": 1e3 * load.batch / overlapped,
            "decode_minutes_projected": load.output * serialized / 60e3,
            "kernel_ms_projected": step["kernels_ms"], "select_ms_projected": step["select_ms"],
            "kernel_silicon_share": step["measured_share"],
            "aiconfigurator_version": step["aiconfigurator_version"], "kernel_system": step["kernel_system"],
            "kernel_data_version": step["kernel_data_version"]}


def view(table, column: str, setting: str = "batch scaling", hardware: str = "h100_sxm"):
    """One projected figure as runners x batch sizes (batch scaling) or x output lengths (decode length): what the
    chapter prints, its name saying it is projected."""
    rows = table[(table.setting == setting) & (table.hardware == hardware)]
    across = "batch_size" if setting == "batch scaling" else "output_tokens"
    out = rows.pivot_table(index="runner", columns=across, values=column, sort=False)
    out.columns.name = (f"{LABELS.get(column, column)} on {hardware} ({setting}), by "
                        f"{'batch size' if across == 'batch_size' else 'output tokens'}")
    out.index.name = None
    return out


LABELS = {"decode_tokens_per_s_projected": "decode tokens/s, projected (aiconfigurator)",
          "decode_tokens_per_s_bound_projected": "decode tokens/s at most, projected (bound)",
          "device_gb_projected": "device memory needed (GB), projected"}
