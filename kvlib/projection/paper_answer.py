"""The paper's stated GPU figures beside the projection of the same settings (kvlib.projection.paper_scale), and the
one sentence that answers its discussion's question: how much of InfiniGen's gap can the host-device bus explain
(read from kvlib.projection.decomposition), and how much would NVLink-C2C close? Every number in the sentences is
read from the projection frame given.
"""

from __future__ import annotations

from kvlib.projection import decomposition
from kvlib.projection.paper_scale import H2O_RATIO

PCIE, C2C = "h100_sxm", "gh200"
DENSE = "paged"  # the paper's vLLM
INFINIGEN = "infinigen (0.3 cap)"  # the most InfiniGen fetches: the reading most generous to the bus
VLLM_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of device memory its engine reserves (configured, not needed)
# The paper's own words (shared/reference/paper-kv-cache-characterization.txt), and the gap each states.
PAPER = {
    "vllm_memory": "vLLM pre-allocates GPU memory for the full context window, maintaining a constant ~72GB "
                   "footprint regardless of batch size",
    "h2o_memory": "H2O takes the opposite approach: aggressive sparsification yields the lowest GPU footprint "
                  "(under 40GB even at batch 96)",
    "infinigen_host": "CPU memory grows substantially with batch size, exceeding 100GB at batch 96",
    "batch_gap": "InfiniGen, however, exhibits an order-of-magnitude lower throughput consistently across all batch "
                 "sizes",
    "length_gap": "vLLM maintains approximately 15x higher throughput than InfiniGen",
    "infinigen_rate": "InfiniGen's throughput, however, remains flat at approximately 8 tokens/second",
    "minutes": "At 8,192 output tokens, InfiniGen requires over 16 minutes compared to vLLM's one minute",
}


def _at(table, hardware: str, runner: str, setting: str, **where):
    rows = table[(table.hardware == hardware) & (table.runner == runner) & (table.setting == setting)]
    for key, value in where.items():
        rows = rows[rows[key] == value]
    return rows


def gaps(table, hardware: str, column: str = "decode_tokens_per_s_projected", batches=None) -> dict:
    """Dense over InfiniGen throughput on `hardware`: per batch (those given, else those where the dense cache fits
    on `hardware`) at batch scaling, and at the longest output at decode length."""
    dense = _at(table, hardware, DENSE, "batch scaling").set_index("batch_size")
    sparse = _at(table, hardware, INFINIGEN, "batch scaling").set_index("batch_size")
    fits = dense[dense.fits_device_projected].index if batches is None else batches
    longest = int(table.output_tokens.max())
    one = _at(table, hardware, DENSE, "decode length", output_tokens=longest)[column].iloc[0]
    other = _at(table, hardware, INFINIGEN, "decode length", output_tokens=longest)[column].iloc[0]
    return {"batch": (dense.loc[fits, column] / sparse.loc[fits, column]), "length": one / other,
            "longest": longest}


def closed(pcie: float, c2c: float) -> float:
    """The share of the bus's part of a gap the faster link removes."""
    return (pcie - c2c) / (pcie - 1) if pcie > 1 else 0.0


def bus_sentence(table) -> str:
    """The answer, from the decomposition of the paper's steps (kvlib.projection.decomposition): the share of its
    slowdown the bus explains at each batch and what else its batch-1 step holds; then what NVLink-C2C would change
    in the projected gap."""
    pcie = gaps(table, PCIE)
    c2c = gaps(table, C2C, batches=pcie["batch"].index)
    return (f"{decomposition.sentence(decomposition.decomposition(table))} Over GH200's NVLink-C2C the projected "
            f"paged-over-InfiniGen gap for one 10K-token prompt at {pcie['longest']:,} outputs falls from "
            f"{pcie['length']:.1f}x to {c2c['length']:.1f}x, closing {closed(pcie['length'], c2c['length']):.0%} of "
            f"the bus's part (projected, not measured).")


def paper_figures(table):
    """Each of the paper's stated figures beside the projection of its setting on H100 SXM over PCIe 5: one row per
    figure, with the quote, the projected (bound) figure (memory needed at least; a throughput at most, a time at
    least), the projected (aiconfigurator) estimate where there is one, and a note."""
    import pandas as pd

    from kvlib import hardware

    top, longest = int(table.batch_size.max()), int(table.output_tokens.max())

    def at(runner, column, setting="batch scaling", **where):
        where = where or ({"batch_size": top} if setting == "batch scaling" else {"output_tokens": longest})
        return _at(table, PCIE, runner, setting, **where)[column].iloc[0]

    def length(runner, column):
        return at(runner, column, "decode length")

    estimate, ceiling = gaps(table, PCIE), gaps(table, PCIE, "decode_tokens_per_s_bound_projected")
    overlapped = gaps(table, PCIE, "decode_tokens_per_s_overlapped_projected")
    device = hardware.load(PCIE).device_memory.value / 1e9
    span = f"batches {estimate['batch'].index.min()}-{estimate['batch'].index.max()} (where paged fits)"
    rows = [
        ("vllm_memory", (f"{at(DENSE, 'device_gb_projected', batch_size=16):.0f} GB at batch 16, "
                        f"{at(DENSE, 'device_gb_projected'):.0f} GB at {top}"), None,
         (f"needed (weights + KV); vLLM reserves {VLLM_GPU_MEMORY_UTILIZATION} x {device:.0f} GB = "
         f"{VLLM_GPU_MEMORY_UTILIZATION * device:.0f} GB, whatever "
         f"it needs (its default gpu_memory_utilization: configured)")),
        ("h2o_memory", f"{at('h2o', 'device_gb_projected'):.0f} GB at batch {top}", None,
         (f"the weights and the kept entries at heavy = recent = {H2O_RATIO} of the prompt (at a total budget of "
          f"{H2O_RATIO}: the H2O section)")),
        ("infinigen_host", f"{at(INFINIGEN, 'host_gb_projected'):.0f} GB at batch {top}", None,
         "the KV alone; the paper's figure adds pinned buffers and pools"),
        ("batch_gap", f"{ceiling['batch'].min():.1f}-{ceiling['batch'].max():.1f}x",
         f"{estimate['batch'].min():.1f}-{estimate['batch'].max():.1f}x",
         f"paged over InfiniGen, {span}; bound column: the ratio of the two throughput ceilings"),
        ("length_gap", f"{ceiling['length']:.1f}x",
         f"{estimate['length']:.1f}x serialized, {overlapped['length']:.1f}x overlapped",
         f"paged over InfiniGen, 10K prompt, {longest:,} outputs; bound column: the ceilings' ratio"),
        ("infinigen_rate", f"at most {length(INFINIGEN, 'decode_tokens_per_s_bound_projected'):.0f} tokens/s",
         f"{length(INFINIGEN, 'decode_tokens_per_s_projected'):.0f} tokens/s", f"10K prompt, {longest:,} outputs"),
        ("minutes", (f"at least {length(INFINIGEN, 'decode_minutes_bound_projected'):.1f} min against "
                    f"{length(DENSE, 'decode_minutes_bound_projected'):.1f}"),
         (f"{length(INFINIGEN, 'decode_minutes_projected'):.1f} min against "
         f"{length(DENSE, 'decode_minutes_projected'):.1f}"), "InfiniGen against paged, the decode phase"),
    ]
    return pd.DataFrame([{"figure": key, "paper (stated)": PAPER[key], "projected (bound)": bound,
                          "projected (aiconfigurator)": guess, "note": note, "hardware": PCIE}
                         for key, bound, guess, note in rows])
