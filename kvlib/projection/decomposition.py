"""The paper's InfiniGen decode steps taken apart: what each term of the official schedule costs at the paper's
shape (kvlib.projection.paper_scale), and what is left of the paper's step once they are summed.

The terms, each labelled by where its figure comes from:
- GPU kernels (projected): aiconfigurator's measured kernels at the attended length, speculation at the roofline;
- the bus (datasheet): the sparse layers' selected KV, the dense layers' whole KV (the official placement keeps every
  layer's cache on the host) and the new tokens' KV written back, each over PCIe Gen5's 64 GB/s; the same bytes at a
  practical rate (assumed) as a separate term;
- the host gather (measured here): the official `select_kv` gathers the selected entries with F.embedding from a
  pageable host cache before the copy; its rate is benchmarks/bench_infinigen_gather.py's on this CPU, and taking it
  to a GPU host is an assumption;
- synchronisations and speculation's launches (counted, cost assumed): the official schedule runs `--overlap false`;
- FlexGen's per-step orchestration (inferred from the paper): InfiniGen's and H2O's official code are both FlexGen
  ports, so the paper's H2O time over the projected H2O step is that code's cost a step, taken as the same for
  InfiniGen.
The paper's own step is read from its words: ~8 tokens/s and over 16 minutes for 8,192 outputs at batch 1; at
batches 16-96 only "an order of magnitude" below vLLM, read over the projected vLLM-like (paged) step.
"""

from __future__ import annotations

import json
import math

from kvlib.projection import paper_scale as scale

PCIE = "h100_sxm"
RUNNER = "infinigen (0.3 cap)"
PRACTICAL_LINK = 53e9  # B/s each way: assumed, PCIe Gen5 x16's 64 GB/s less its packet overheads (~83 %)
# Counted from the official code (snu-comparch/InfiniGen, speedup/): kv_selection_controller.py's
# speculate_attention launches 12 kernels (linear, a reshape's copy, bmm, max, sub, repeat, ones_like, zeros_like,
# where, sum, mean, topk) and syncs twice a sparse layer (its `.item()`, select_kv's index copy to the host);
# flexgen/infinigen/flex_opt.py's generation_loop_normal (the scripts' `--overlap false`) syncs after each of its
# layers (input embedding, attention and MLP apart, output embedding: 2 a transformer layer and 2 more) and once
# more before each attention layer but the first and last.
SPECULATION_LAUNCHES = 12
SYNCS_PER_SPARSE_LAYER = 2
SYNC_S, LAUNCH_S = 10e-6, 5e-6  # assumed: an idle device's round trip; an eager PyTorch op's dispatch and launch
GATHER_JSON = "benchmarks/results/infinigen_gather.json"
GATHER_WAY = "embedding (new tensor)"  # the official select_kv's F.embedding, a new pageable tensor each call
# The paper's words (its section IV-C): InfiniGen "flat at approximately 8 tokens/second", "over 16 minutes compared
# to vLLM's one minute" at 8,192 outputs, "H2O occupies the middle ground at approximately 3 minutes".
PAPER_BATCH_GAP = 10.0  # its batch scaling: InfiniGen "an order-of-magnitude lower throughput" than vLLM
PAPER_INFINIGEN_RATE, PAPER_INFINIGEN_MINUTES, PAPER_H2O_MINUTES, PAPER_VLLM_MINUTES = 8.0, 16.0, 3.0, 1.0
CASES = (("decode length", 1, 512), ("decode length", 1, 8192), ("batch scaling", 16, 512),
         ("batch scaling", 64, 512), ("batch scaling", 96, 512))
BUS = ("bus: sparse layers' selected KV, host to device", "bus: dense layers' whole KV, host to device",
       "bus: new tokens' KV written back, device to host")
PRACTICAL = "bus: the same bytes at the practical rate instead (extra time)"
GATHER = "host gather of the selected entries from pageable memory"
EXPLAINED, PAPER_STEP, RESIDUAL, PAGED = ("explained (sum of the terms above)", "the paper's InfiniGen step",
                                          "residual: the paper's step less the terms", "vLLM-like (paged) step")


def official_syncs(layers: int, sparse: int) -> int:
    """A decode step's synchronisations in the official schedule: after each of FlexGen's 2 x layers + 2 layers,
    before each attention but the first and last, and the sparse layers' own."""
    return (2 * layers + 2) + (layers - 2) + SYNCS_PER_SPARSE_LAYER * sparse


def gather_rate(share: float, path=None) -> dict | None:
    """The measured host gather rate (B/s) of the official way at the share nearest `share`, with its label; None
    where benchmarks/bench_infinigen_gather.py has not written its results."""
    from kvlib.paths import repo_root

    path = path or repo_root() / GATHER_JSON
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    rows = [r for r in raw.get("gather", []) if r.get("way") == GATHER_WAY]
    if not rows:
        return None
    row = min(rows, key=lambda r: abs(r["share"] - share))
    return {"rate": row["gb_per_s"] * 1e9,
            "label": (f"measured here: F.embedding from pageable memory at share {row['share']}, "
                      f"{row['gb_per_s']:.1f} GB/s on {raw.get('cpu', 'this CPU')} ({raw.get('cpu_threads', '?')} "
                      f"thread, {GATHER_JSON}); a GPU host's rate assumed the same")}


def case_name(load: scale.Workload) -> str:
    around = "~" if load.setting == "batch scaling" else ""
    return f"batch {load.batch}, {around}{load.prompt:,} + {load.output:,} tokens (ms)"


def paper_step_ms(load: scale.Workload, paged_ms: float, rate: float = PAPER_INFINIGEN_RATE) -> tuple[float, str]:
    if load.setting == "decode length" and load.output == max(scale.OUTPUTS):
        return PAPER_INFINIGEN_MINUTES * 60e3 / load.output, "over 16 minutes for 8,192 outputs"
    if load.setting == "decode length":
        return 1e3 / rate, f"~{rate:.0f} tokens/s at every output length"
    return PAPER_BATCH_GAP * paged_ms, "an order of magnitude over the projected paged step"


def decomposition(table, runner: str = RUNNER, gather: dict | None = None, practical_link: float = PRACTICAL_LINK,
                  paper_rate: float = PAPER_INFINIGEN_RATE):
    """The decomposition as a table: one row a term (what, which kind of figure, its basis), one column a case
    (batch 1 at 512 and 8,192 outputs, batches 16, 64, 96), in ms a step, the residual printed as a row."""
    import pandas as pd

    from kvlib import hardware
    from kvlib.models import model_config
    from kvlib.models.pass_shape import PassShape

    spec = hardware.load(PCIE)
    shape = PassShape.of(model_config(scale.MODEL), scale.DTYPE_BYTES)
    rows = table[table.hardware == PCIE]
    ig = rows[rows.runner == runner]
    share = float(ig.fetch_share.iloc[0])
    gather = gather if gather is not None else gather_rate(share)
    link = spec.link_bandwidth.value
    sparse, dense = shape.num_layers - scale.INFINIGEN_DENSE_LAYERS, scale.INFINIGEN_DENSE_LAYERS
    per_token = shape.num_kv_heads * shape.kv_token_bytes  # one layer's K and V of one token
    h2o_long = rows[(rows.runner == "h2o") & (rows.setting == "decode length")
                    & (rows.output_tokens == max(scale.OUTPUTS))].decode_step_ms_projected.iloc[0]
    orchestration = PAPER_H2O_MINUTES * 60e3 / max(scale.OUTPUTS) - h2o_long
    syncs = official_syncs(shape.num_layers, sparse)
    launches = SPECULATION_LAUNCHES * sparse
    columns, readings = {}, []
    for setting, batch, output in CASES:
        at = (rows.setting == setting) & (rows.batch_size == batch) & (rows.output_tokens == output)
        load = scale.Workload(setting, batch, int(rows[at].prompt_tokens.iloc[0]), output)
        mine, paged = rows[at & (rows.runner == runner)].iloc[0], rows[at & (rows.runner == "paged")].iloc[0]
        fetched = sparse * batch * share * load.mean_held * per_token
        bus = (fetched, dense * batch * load.mean_held * per_token, batch * shape.num_layers * per_token)
        terms = [mine.kernel_ms_projected + mine.select_ms_projected,
                 1e3 * (bus[0] / link + 2 * sparse * spec.link_latency.value), 1e3 * bus[1] / link,
                 1e3 * bus[2] / link, 1e3 * sum(bus) * (1 / practical_link - 1 / link),
                 1e3 * fetched / gather["rate"] if gather else math.nan,
                 1e3 * syncs * SYNC_S, 1e3 * launches * LAUNCH_S, orchestration]
        explained = sum(t for t in terms if not math.isnan(t))
        step, read = paper_step_ms(load, paged.decode_step_ms_projected, paper_rate)
        columns[case_name(load)] = terms + [explained, step, step - explained, paged.decode_step_ms_projected]
        readings.append(f"{case_name(load)[:-5]}: {read}")
    residuals = [values[-2] for values in columns.values()]
    labels = _labels(mine.kernel_data_version, share, sparse, dense, shape.num_layers, practical_link, gather, syncs,
                     launches, h2o_long, readings, residuals)
    frame = pd.DataFrame([{"term": t, "kind": k, "basis": b} for t, k, b in labels])
    for name, values in columns.items():
        frame[name] = values
    frame.attrs["gather_rate"] = gather["rate"] if gather else None
    return frame


def _labels(version: str, share: float, sparse: int, dense: int, layers: int, practical_link: float,
            gather: dict | None, syncs: int, launches: int, h2o_long: float, readings: list[str],
            residuals: list[float]) -> list[tuple[str, str, str]]:
    """(term, kind of figure, its basis) for each row of the decomposition, in its order."""
    return [
        ("GPU kernels: the layers, InfiniGen's attention and speculation", "projected",
         (f"aiconfigurator's measured {version} kernels on H100 SXM at the attended length; speculation at the "
         f"datasheet roofline")),
        (BUS[0], "datasheet", (f"share {share:.2f} of the held tokens in {sparse} layers, at 64 GB/s (PCIe Gen5 x16, "
                              f"H100 SXM datasheet), 1 us a copy")),
        (BUS[1], "datasheet", f"every held token in the {dense} dense layers, at 64 GB/s"),
        (BUS[2], "datasheet", f"one token a row in {layers} layers, at 64 GB/s"),
        (PRACTICAL, "assumed", f"the three bus terms at {practical_link / 1e9:.0f} GB/s in place of 64"),
        (GATHER, "measured here" if gather else "parameter",
         gather["label"] if gather else f"not measured: {GATHER_JSON} is missing, so the term is left out"),
        (f"synchronisations: {syncs} a step", "counted; cost assumed",
         (f"after each attention, MLP and embedding, before each attention but the end layers', "
          f"{SYNCS_PER_SPARSE_LAYER} more a sparse layer (speculation's .item(), the index copied to the host); "
          f"{SYNC_S * 1e6:.0f} us each")),
        (f"speculation's kernel launches: {launches} a step", "counted; cost assumed",
         f"{SPECULATION_LAUNCHES} a sparse layer, {LAUNCH_S * 1e6:.0f} us each"),
        ("FlexGen's per-step orchestration", "inferred from the paper",
         (f"its H2O's {PAPER_H2O_MINUTES:.0f} min over {max(scale.OUTPUTS):,} steps less the projected H2O step "
         f"({h2o_long:.1f} ms); taken as the same a step at every batch; it may hold some of the syncs above")),
        (EXPLAINED, "sum", "the terms above (a term left out counts nothing)"),
        (PAPER_STEP, "inferred from the paper", "; ".join(readings)),
        (RESIDUAL, "what the model does not explain", _residual_basis(residuals)),
        (PAGED, "projected", f"aiconfigurator's measured {version} kernels, the whole cache on the device"),
    ]


def _residual_basis(residuals: list[float]) -> str:
    """What the residual's sign says, read from the residuals themselves."""
    if all(r < 0 for r in residuals):
        return "negative in every case: the terms sum to more than the paper's step"
    if all(r >= 0 for r in residuals):
        return "the part of the paper's step no term above accounts for"
    return "negative where the terms sum to more than the paper's step, else the part no term accounts for"


def gather_needed(frame, case: str) -> float | None:
    """The gather rate (B/s) at which the terms sum to the paper's step in `case`: the time left for the gather
    once every other term is paid; None where nothing is left or the gather is not known."""
    rate = frame.attrs.get("gather_rate")
    terms = frame.set_index("term")
    gather_ms = terms.loc[GATHER, case]
    left = gather_ms + terms.loc[RESIDUAL, case]
    return None if not rate or math.isnan(gather_ms) or left <= 0 else rate * gather_ms / left


def bus_shares(frame) -> dict:
    """Per case: the bus's time (datasheet, and at the practical rate) over the paper's slowdown against vLLM-like
    decoding (the paper's step less the projected paged step)."""
    terms = frame.set_index("term")
    out = {}
    for case in frame.columns[3:]:
        bus = sum(terms.loc[name, case] for name in BUS)
        slowdown = terms.loc[PAPER_STEP, case] - terms.loc[PAGED, case]
        out[case] = {"bus_ms": bus, "practical_ms": bus + terms.loc[PRACTICAL, case], "slowdown_ms": slowdown,
                     "share": bus / slowdown, "practical_share": (bus + terms.loc[PRACTICAL, case]) / slowdown,
                     "step_ms": terms.loc[PAPER_STEP, case], "residual_ms": terms.loc[RESIDUAL, case]}
    return out


def sentence(frame) -> str:
    """What share of the paper's slowdown the bus explains at each batch, and what else the batch-1 step holds:
    every number read from the decomposition."""
    shares = bus_shares(frame)
    terms = frame.set_index("term")
    first = next(iter(shares))

    def part(case):
        s = shares[case]
        return (f"{s['share']:.0%}-{s['practical_share']:.0%} at batch {case.split(',')[0].split()[-1]} "
                f"({s['bus_ms']:.0f}-{s['practical_ms']:.0f} ms of a {s['slowdown_ms']:.0f} ms slowdown)")

    batches = [c for c in shares if c == first or not c.startswith("batch 1,")]
    rest = [(name, terms.loc[name, first]) for name in terms.index
            if name not in (*BUS, PRACTICAL, EXPLAINED, PAPER_STEP, RESIDUAL, PAGED)]
    listed = "; ".join(f"{name.split(':')[0]} {ms:.1f} ms" if not math.isnan(ms) else f"{name}: not known"
                       for name, ms in rest)
    over = ("; above 100 %, the bus alone, serialized as the official schedule runs it, takes longer than the step "
            "so read: there the paper's gap is wider than that reading"
            if any(shares[c]["share"] > 1 for c in batches) else "")
    residual = shares[first]["residual_ms"]
    if residual >= 0:
        tail = f"a residual of {residual:.0f} ms the model does not explain"
    else:
        needed, rate = gather_needed(frame, first), frame.attrs.get("gather_rate")
        tail = (f"the terms exceed the paper's step by {-residual:.0f} ms, so at least one is overstated for the "
                f"paper's host" + (f": the gather fits only at {needed / 1e9:.1f} GB/s or more, against "
                                   f"{rate / 1e9:.1f} GB/s measured on this CPU" if needed else ""))
    return (f"Taken apart at the paper's shape (Llama-3.1-8B in bf16 on one H100 SXM over PCIe 5, InfiniGen fetching "
            f"at its 0.3 cap, the dense layers' KV and the write-back crossing the bus as the official placement "
            f"has them), the bus at 64-{PRACTICAL_LINK / 1e9:.0f} GB/s explains, of the paper's slowdown against "
            f"vLLM-like decoding, {', '.join(part(c) for c in batches)} (projected; the paper's step at batches "
            f"16-96 is read from its \"order of magnitude\" over the projected paged step, so those shares are only "
            f"as good as that reading{over}). The rest of the paper's {shares[first]['step_ms']:.0f} ms batch-1 step, by "
            f"the model: {listed}; {tail}.")


SHARE_JSON = "benchmarks/results/infinigen_share.json"
LONG = "long prompts"


def long_prompt_share(path=None) -> tuple[float | None, str]:
    """InfiniGen's share measured at long prompts by benchmarks/bench_infinigen_share.py (mean over its prompt
    lengths), with the model and lengths; (None, why) where it has not been run."""
    from kvlib.paths import repo_root

    path = path or repo_root() / SHARE_JSON
    if not path.is_file():
        return None, f"not measured: {SHARE_JSON} is missing (benchmarks/bench_infinigen_share.py not run)"
    raw = json.loads(path.read_text())
    rows = raw["rows"]
    each = ", ".join(f"{r['share']:.2f} at {r['prompt_tokens']:,}" for r in rows)
    return (sum(r["share"] for r in rows) / len(rows),
            f"measured: {raw['model']}, one prompt each of {each} tokens, budget {raw['budget']} ({SHARE_JSON})")


def share_sensitivity(profile: str, shares=(0.1, None, LONG, 0.3), kernels: bool = True):
    """InfiniGen's projected decode throughput on H100 SXM at the paper's settings over its attended share (None:
    the profile's measured share, LONG: the share measured at long prompts; each labelled with the model and prompt
    lengths it was measured at)."""
    import pandas as pd

    rows = []
    for share in shares:
        source = "given"
        if share is None or share == LONG:
            share, source = scale.measured_fetch_share(profile) if share is None else long_prompt_share()
            if share is None:
                continue
        ig = scale.Runner(f"infinigen at {share:.2f}", "infinigen", share, source)
        table = scale.projection(hardware_names=(PCIE,), kernels=kernels, runner_list=[ig, scale.Runner("paged", "paged")])
        column = "decode_tokens_per_s_projected" if "decode_tokens_per_s_projected" in table else \
            "decode_tokens_per_s_bound_projected"
        row = {"InfiniGen's attended share": share,
               "where the share is from": source if source != "given" else "set here"}
        for setting, batch, output in CASES[1:]:
            at = table[(table.setting == setting) & (table.batch_size == batch) & (table.output_tokens == output)]
            mine, paged = at[at.policy == "infinigen"][column].iloc[0], at[at.policy == "paged"][column].iloc[0]
            name = f"batch {batch}, {'~' if setting == 'batch scaling' else ''}{int(at.prompt_tokens.iloc[0]):,} + {output:,}"
            row[f"{name}: tokens/s (projected)"] = mine
            if batch in (1, 16):
                row[f"{name}: paged / InfiniGen (projected)"] = paged / mine
        rows.append(row)
    return pd.DataFrame(rows)


def h2o_beside_paper(kernels: bool = True):
    """The paper's H2O (its decode time at 8,192 outputs, its device memory at batch 96) beside the projection, at
    the rule kvlib and the H2O authors' FlexGen port keep (heavy = recent = 0.3 of the prompt) and at a total budget
    of 0.3 (heavy = recent = 0.15), with the gap."""
    import pandas as pd

    long = scale.Workload("decode length", 1, scale.DECODE_PROMPT, max(scale.OUTPUTS))
    wide = scale.Workload("batch scaling", max(scale.BATCHES), sum(scale.PROMPT_RANGE) // 2, scale.BATCH_OUTPUT)
    rules = {"heavy = recent = 0.3": scale.H2O_RATIO, "heavy + recent = 0.3": scale.H2O_RATIO / 2}
    runners = [scale.Runner(name, "h2o", h2o_ratio=ratio) for name, ratio in rules.items()]
    table = scale.projection(hardware_names=(PCIE,), kernels=kernels, loads=[long, wide],
                             runner_list=[*runners, scale.Runner("paged", "paged")]).set_index(["runner", "setting"])
    minutes = "decode_minutes_projected" if "decode_minutes_projected" in table else "decode_minutes_bound_projected"
    paged = table.loc[("paged", long.setting), minutes]
    time_row = {"figure": f"decode time, batch 1, {long.prompt:,}-token prompt, {long.output:,} outputs (min)",
                "the paper (stated)": f"~{PAPER_H2O_MINUTES:.0f} (vLLM: {PAPER_VLLM_MINUTES:.0f})"}
    memory_row = {"figure": f"device memory at batch {wide.batch} (GB)", "the paper (stated)": "under 40"}
    for name in rules:
        mine = table.loc[(name, long.setting), minutes]
        time_row[f"projected, {name}"] = f"{mine:.2f} (paged: {paged:.2f})"
        memory_row[f"projected, {name}"] = f"{table.loc[(name, wide.setting), 'device_gb_projected']:.0f}"
    kept = table.loc[("heavy = recent = 0.3", long.setting), minutes]
    extra_ms = ((PAPER_H2O_MINUTES - PAPER_VLLM_MINUTES) - (kept - paged)) * 60e3 / long.output
    time_row["the gap"] = (f"the paper's H2O takes {PAPER_H2O_MINUTES / PAPER_VLLM_MINUTES:.0f}x vLLM's time, the "
                           f"projection {kept / paged:.2f}x paged's: ~{extra_ms:.0f} ms a step the projection does not "
                           f"model (FlexGen's orchestration, inferred)")
    fits = [name for name in rules if table.loc[(name, wide.setting), "device_gb_projected"] < 40]
    memory_row["the gap"] = (f"only {', '.join(fits)} reproduces the paper's figure" if fits else
                             "neither rule reproduces the paper's figure")
    return pd.DataFrame([time_row, memory_row])
