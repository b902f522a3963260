"""InfiniGen (Lee et al., OSDI 2024): the full KV cache in the host tier, the entries that matter fetched each step.

Offline, kvlib.policies.infinigen_skew finds per layer and KV head an orthogonal matrix A that packs the query-key product into few
columns, and keeps `partial_ratio` of them. Every cached key also goes, skewed and cut to those columns, into a small
partial key cache in the device tier. At decode, while layer i runs, its attention input and layer i+1's query
projection (then RoPE, then A: Llama rotates after projecting, so A cannot be folded into the weights) give approximate
scores of layer i+1 against the partial keys. Tokens whose approximate logit is within `alpha` of the head's maximum
are candidates; their mean count over heads, capped by `budget` x cached tokens, is how many each head fetches (its
best-scored ones). Only those keys and values are copied from the host tier to the device tier for layer i+1; the first
`dense_layers` layers stay dense on the device.

On CUDA the selected entries are gathered on the host into a reused pinned buffer (sized at the first fetch, grown
when a fetch needs more) and copied to the device on a side stream; the layer that reads them waits for the copy on
the device (an event), not on the host. The host tier itself stays pageable: only the buffer is copied from, so only
it needs pinning. The fetch does not overlap layer i's compute as the official code's does: the selected indices are
needed on the host to gather from the host tier, so each sparse layer synchronizes the host once (its index list is
made on the CPU) before its gather. The `fetch` timer section then holds the host-side gather and the copy's issue;
the copy itself is waited for, and counted, in the next layer's compute. Each step's new keys and values go the other
way, to the host tier, and are counted as crossing it (`device_to_host` in kvlib.memory.work).

On a CPU both tiers are one memory, and the copy would only add a read and a write of every selected entry (and
another of them to append the new token): there a sparse layer reads the selected entries where they lie, through an
index list per row and KV head into the host tier, which the one decode kernel reads as it reads any block table, and
nothing is counted as moved. `fetch=True` keeps the copy on a CPU too (the GPU's path, which the tests run here).

The budget is a cap, as in the official code (kvlib.policies.infinigen_speculation: alpha, not the budget, decides
what a row fetches wherever the candidates are fewer than the cap): what a run actually attended is reported
(`kv_share_attended`) and the book places InfiniGen there, next to the configured cap. `measure_coverage` also reads
each step's true attention: the mass speculation's picks carry against the mass the oracle's best picks of the same
count carry, per layer (`speculation_recall`). Where kvlib follows the official code and where it departs, rule by
rule: `fidelity` below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlib.errors import UserError
from kvlib.kernels.attention import prefill_attention
from kvlib.kernels.decode import DecodeReads
from kvlib.models.llama_forward import QueryProjection, attention_modules
from kvlib.policies import infinigen_coverage, infinigen_one_pass
from kvlib.policies import infinigen_speculation as speculation
from kvlib.policies.base import BudgetedPolicy, Step
from kvlib.policies.fidelity import Fidelity, Rule, Source
from kvlib.policies.infinigen_fetch import StagedFetch
from kvlib.policies.infinigen_one_pass import CANDIDATES, by_protocol
from kvlib.policies.infinigen_skew import BASES, load_or_compute_skew
from kvlib.policies.registry import register


@register
@dataclass
class InfiniGenPolicy(StagedFetch, BudgetedPolicy):
    name = "infinigen"
    keeps_all_example: ClassVar[dict] = {"budget": 1.0, "alpha": 1e9}  # every token speculated and fetched
    calibrates = True
    adopts_prefill = True
    host_tensors = ("host_k", "host_v")
    reads = "the entries a speculation of each layer's attention selects, each step"
    one_pass_source = "snu-comparch/InfiniGen@3754f52 accuracy/src/modeling_llama_ours.py"
    fidelity = Fidelity(
        Source("snu-comparch/InfiniGen", "3754f52d131c30ab7a310e3c4cf356e8e3326ac3",
               "accuracy/src/modeling_llama_ours.py, accuracy/setup/*, speedup/infinigen/kv_selection_controller.py"),
        rules=(
            Rule("candidates", CANDIDATES, kvlib=CANDIDATES),
            Rule("alpha", 5.0, setting="alpha"),
            Rule("fetch count", "int(mean over heads of the candidates), at most int(budget x tokens)",
                 kvlib="int(mean over heads of the candidates), at most int(budget x tokens)"),
            *by_protocol("cap's tokens", "the whole sequence (lm-eval's one pass: context + continuation)",
                         "the tokens cached at the step", "as a deployed system selects; the cap grows with the row"),
            *by_protocol("where it selects", "every query position past int(budget x tokens)",
                         "decode steps (the context prefilled dense)", "as the speedup code runs (kvlib.evaluation.lm)"),
            *by_protocol("fewest fetched", "0 (the official mask then attends everything)", "1 and the new token",
                         "a row always reads its best entry"),
            Rule("partial ratio", 0.2, setting="partial_ratio"),
            Rule("skewing basis", "query", setting="skew_basis"),
            Rule("partial columns", "int(r x D) by |QA| united with int(r x D) by |KA|",
                 kvlib="int(r x D) by |QA| united with int(r x D) by |KA|"),
            Rule("heads", "multi-head: one A and one selection per query head", kvlib="one A per KV head; one "
                 "selection per query head (one pass), per KV head, the max over its group (decode steps)",
                 differs="grouped-query models: the one pass shares no cache, decode steps share the KV head's"),
            Rule("dense layers", 2, setting="dense_layers"),
            Rule("dense layers' cache", "offloaded with the rest: each step fetches their whole KV over the bus",
                 kvlib="on the device: their KV never crosses the bus",
                 differs="kvlib's work counter has the sparse layers' fetches alone; the paper-scale decomposition "
                         "adds the dense layers' bytes as the official placement moves them"),
            Rule("speculation input", "layer i's attention input x layer i+1's query weights",
                 kvlib="layer i's attention input x layer i+1's query weights"),
        ))

    partial_ratio: float = 0.2  # share of each head's dimensions speculation uses (the official default)
    # candidates: approximate logit within alpha of the head's max (weight within e^-alpha; the one pass: the first
    # head's max, as the official accuracy code, kvlib.policies.infinigen_one_pass); the official runs use 5 on
    # Llama (4 on OPT); alpha=inf makes the budget bind, every head fetching its cap (the official figure 13: alpha 99)
    alpha: float = 5.0
    skew: bool = True
    skew_basis: str = "query"  # the official basis and columns; "joint": kvlib's earlier rule (infinigen_skew)
    dense_layers: int = 2
    calibration_tokens: int = 512
    measure_coverage: bool = False  # also compute the true attention, to report speculation quality
    fetch: bool | None = None  # copy the selected entries to the device tier (None: only where the tiers are apart)

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.partial_ratio <= 1:
            raise UserError(f"partial_ratio must be in (0, 1], got {self.partial_ratio}")
        if self.alpha < 0:
            raise UserError(f"alpha must be >= 0, got {self.alpha}")
        if self.skew_basis not in BASES:
            raise UserError(f"skew_basis must be one of {BASES}, got {self.skew_basis!r}")
        if self.dense_layers < 1:
            raise UserError(f"dense_layers must be >= 1 (layer 0 has no earlier layer to speculate from), "
                            f"got {self.dense_layers}")

    def bind(self, model, ledger, timers):
        super().bind(model, ledger, timers)
        self.attn_modules = attention_modules(model.model, self.name)
        # speculation for a sparse layer needs its query only: its own projection, not the fused Q/K/V
        self.queries = {layer: QueryProjection(self.attn_modules[layer])
                        for layer in range(min(self.dense_layers, len(self.attn_modules)), len(self.attn_modules))}
        self.query_bytes = sum(q.copied_bytes for q in self.queries.values())

    def _fetches(self) -> bool:
        if self.fetch is None:
            return self.device.type != "cpu"
        if not self.fetch and self.device.type != "cpu":
            raise UserError("infinigen's fetch=False reads the host tier in place, which needs the device to be the "
                            f"host (a CPU run); this run's device is {self.device}")
        return self.fetch

    def calibrate(self, prompt):
        skew = load_or_compute_skew(self.model, prompt[:self.calibration_tokens], self.partial_ratio, self.skew,
                                    self.skew_basis)
        self.skew_cut = skew.cut().to(self.device)

    # the official accuracy harness's masked pass (kvlib.evaluation.one_pass), by kvlib.policies.infinigen_one_pass
    one_pass_session = infinigen_one_pass.session
    one_pass_keep = infinigen_one_pass.keep_for

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def start(self, batch_size, prompt_lens, max_new_tokens):
        s = self.spec
        self.dense = min(self.dense_layers, s.num_layers)
        sparse = s.num_layers - self.dense
        cap = max(prompt_lens) + max_new_tokens
        r = self.skew_cut.shape[-1]
        skew_bytes = self.skew_cut.nbytes
        # serving: the rows the device tier holds (its dense layers and partial keys); the host tier has no capacity
        row_device = (self.dense * 2 * s.head_dim + sparse * r) * s.num_kv_heads * cap * s.dtype_bytes
        rows = self.row_capacity(batch_size, row_device, beside=skew_bytes + self.query_bytes)
        shape = (rows, s.num_kv_heads, cap, s.head_dim)
        self.fetches = self._fetches()
        self.decode_steps = 0
        self.coverage: list[tuple[int, float, float]] = []  # measure_coverage: (layer, picks' mass, oracle's)
        self.ledger.add("device", "kv_reserved", self.dense * 2 * math.prod(shape) * s.dtype_bytes,
                        where="infinigen dense layers")
        self.ledger.add("device", "overhead", sparse * math.prod(shape[:3]) * r * s.dtype_bytes + skew_bytes
                        + self.query_bytes, where="infinigen partial key cache, skewing matrices, query projections")
        self.ledger.add("host", "kv_reserved", sparse * 2 * math.prod(shape) * s.dtype_bytes)
        self.dense_k = torch.zeros((self.dense, *shape), dtype=s.dtype, device=self.device)
        self.dense_v = torch.zeros_like(self.dense_k)
        # host tier: pageable, the fetch copies from the pinned staging buffer (_gather) instead
        self.host_k, self.host_v = (torch.zeros((sparse, *shape), dtype=s.dtype) for _ in range(2))
        # [layer, row, head, r, token]: token-minor, so speculation's product with the partial query is one plain
        # matmul (0.10 against 0.31 ms a layer at 8 rows of 2,048 tokens in the einsum over a token-major cache)
        self.partial_k = torch.zeros((sparse, *shape[:2], r, shape[2]), dtype=s.dtype, device=self.device)
        self.lengths = torch.zeros(rows, dtype=torch.long)
        # layer -> (index list [B, Hkv, W] (_select), picks per row, fetched keys, values or None where read in place)
        self.fetched: dict[int, tuple] = {}
        self.captured: dict[int, tuple] = {}  # layer -> (attention input, (cos, sin)) of the current pass
        self._reset_fetch(cuda=self.device.type == "cuda")
        # only the layers that speculate for a sparse next layer need their input
        self.hooks = [self.attn_modules[i].register_forward_pre_hook(self._capture_input(i), with_kwargs=True)
                      for i in range(max(self.dense - 1, 0), s.num_layers - 1)]

    def _capture_input(self, layer: int):
        def hook(module, args, kwargs):
            step = kwargs.get("kv_step")
            if step is not None and step.policy is self and step.phase == "decode":
                self.captured[layer] = (kwargs["hidden_states"], kwargs["position_embeddings"])
        return hook

    def finish(self):
        for hook in getattr(self, "hooks", []):
            hook.remove()
        self.hooks = []
        self.dense_k = self.dense_v = self.host_k = self.host_v = self.partial_k = None
        self._reset_fetch()
        self.fetched, self.captured = {}, {}
        for tier in ("device", "host"):
            self.ledger.set(tier, kv=0, kv_reserved=0, overhead=0)

    # -- storage ---------------------------------------------------------------------------------------------------
    def _store(self, layer, rows, pos, key, value, phase):
        """Write new keys/values [B, Hkv, T, D] at positions pos [B, T]; skewed partial keys go to the device."""
        r = rows[:, None, None]
        heads = torch.arange(key.shape[1])[None, :, None]
        p = pos[:, None, :]
        if layer < self.dense:
            self.dense_k[layer][r, heads, p] = key
            self.dense_v[layer][r, heads, p] = value
            return
        i = layer - self.dense
        with self.timers.section("offload"):
            # a blocking copy: a non-blocking one into pageable memory could be read before it lands
            self.host_k[i][r, heads, p] = key.to("cpu")
            self.host_v[i][r, heads, p] = value.to("cpu")
        for entries in (key, value):  # the write-back crosses the tiers as the fetch does (counted alike on a CPU)
            self.work.transfer(phase, "device_to_host", entries.nbytes)
        with self.timers.section("selection"):  # (advanced indices first: [B, Hkv, T, r])
            self.partial_k[i][r, heads, :, p] = torch.matmul(key, self.skew_cut[layer])

    def adopt_pass(self, layer, recorded, step: Step):
        self._store(layer, step.rows, step.start[:, None] + torch.arange(step.q_len)[None, :], recorded.key(layer),
                    recorded.value(layer), step.phase)

    def attend(self, layer, query, key, value, step: Step):
        t = step.q_len
        pos = step.start[:, None] + torch.arange(t)[None, :]
        self._store(layer, step.rows, pos, key, value, step.phase)
        if step.phase == "prefill":
            row, end = int(step.rows[0]), int(step.start[0]) + t
            if layer < self.dense:
                k, v = self.dense_k[layer, row:row + 1, :, :end], self.dense_v[layer, row:row + 1, :, :end]
            else:
                k = self.host_k[layer - self.dense, row:row + 1, :, :end]
                v = self.host_v[layer - self.dense, row:row + 1, :, :end]
            # on CUDA the row's keys and values are copied to the device for this layer's attention: booked while live
            copied = 2 * k.nbytes if k.device.type != self.device.type else 0
            with self.ledger.transient("device", "activations", copied, f"infinigen prefill, layer {layer}"):
                return prefill_attention(query, k.to(self.device), v.to(self.device), int(step.start[0]),
                                         step.prefill_mode, self.scale, self.ledger, layer)
        out = self._decode_attention(layer, query, key, value, step)
        if self.dense <= layer + 1 < self.spec.num_layers:
            self._speculate_and_fetch(layer, step)
        return out

    # -- decode ----------------------------------------------------------------------------------------------------
    def _decode_attention(self, layer, query, key, value, step):
        rows = step.rows
        if layer < self.dense:  # read as `full` reads its rows
            self.usage.add(layer, step.tokens_seen, step.tokens_seen, len(rows))
            reads = DecodeReads(self.dense_k[layer], self.dense_v[layer], step.start + 1, rows=rows)
            return self.decode_attention(layer, query, reads)[0]
        table, count, k_sel, v_sel = self.fetched.pop(layer)
        # the current token's own key/value was computed just now: it is always attended, right after each row's
        # count[b] picks, so a row reads its first count + 1
        if k_sel is None:  # read in place: the new token is in the host tier already (stored above)
            out, _ = self.decode_attention(layer, query, DecodeReads(self.host_k[layer - self.dense],
                                                                     self.host_v[layer - self.dense], count + 1,
                                                                     rows=rows, table=table))
        else:
            out = self._attend_fetched(layer, query, key, value, k_sel, v_sel, count)
        self.usage.add(layer, int(count.sum()) + len(rows), step.tokens_seen, len(rows))
        if self.measure_coverage:
            self._record_coverage(layer, query, key, step, table[..., :int(count.max())], count)
        return out

    def _attend_fetched(self, layer, query, key, value, k_sel, v_sel, count):
        self._wait_for_copy()
        rows = len(count)
        with self.ledger.transient("device", "activations", k_sel.nbytes + v_sel.nbytes + key.nbytes + value.nbytes,
                                   f"infinigen fetched and new entries, layer {layer}"):
            k_all = torch.cat([k_sel, key], dim=2)
            v_all = torch.cat([v_sel, value], dim=2)
            own = torch.arange(rows)
            at = count.to(self.device)
            k_all[own.to(self.device), :, at] = key[:, :, 0]
            v_all[own.to(self.device), :, at] = value[:, :, 0]
            out, _ = self.decode_attention(layer, query, DecodeReads(k_all, v_all, count + 1, rows=own))
        self.ledger.add("device", "kv", -(k_sel.nbytes + v_sel.nbytes))  # the fetched entries are dropped now
        return out

    def _speculate_and_fetch(self, layer: int, step: Step):
        """During layer `layer`, pick and fetch the entries layer+1 will attend to."""
        nxt = layer + 1
        rows, s = step.rows, self.spec
        group = s.num_attention_heads // s.num_kv_heads
        with self.timers.section("selection"):
            hidden, (cos, sin) = self.captured.pop(layer)
            q = self.queries[nxt](hidden, (cos, sin)).reshape(len(rows), s.num_kv_heads, group, s.head_dim)
            q_part = torch.matmul(q, self.skew_cut[nxt])  # [B, Hkv, G, r]
            table, count = self._select(nxt, q_part, step)
        self.work.add("decode", **speculation.work(s, q_part.shape[-1], len(rows), int(step.start.sum())))
        idx = table[..., :int(count.max())]
        # every row gathers count.max() entries per head (the rest masked): what leaves the host tier, copied to the
        # device, or read in place where both tiers are one memory (counted alike: the machine's spec says which)
        moved = 2 * math.prod(idx.shape) * s.head_dim * s.dtype_bytes
        for _ in range(2):  # the keys, then the values: a copy each
            self.work.transfer("decode", "host_to_device", moved // 2)
        if not self.fetches:
            self.fetched[nxt] = (table, count, None, None)
            return
        with self.timers.section("fetch"):
            self.ledger.add("device", "kv", moved, where=f"infinigen fetch, layer {nxt}")
            self.fetched[nxt] = (table, count, *self._copy(*self._gather(nxt - self.dense, rows, idx)))

    def _select(self, layer: int, q_part: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """What each (row, KV head) of `layer` reads this step (kvlib.policies.infinigen_speculation.select)."""
        cap = torch.tensor([speculation.fetch_cap(self.budget, self.budget_tokens, int(n)) for n in step.start])
        return speculation.select(q_part, self.partial_k[layer - self.dense], step.rows, step.start, cap, self.scale,
                                  self.alpha, self.decode_kernel)

    def _record_coverage(self, layer, query, key, step, chosen, count):
        """The true attention of layer over the whole cache, and the mass the picks and the oracle's carry of it."""
        cached = self.host_k[layer - self.dense][step.rows, :, :int(step.start.max())].to(self.device)
        probs = infinigen_coverage.true_attention(query, torch.cat([cached, key], dim=2), step.start, self.scale)
        self.coverage.append((layer, *infinigen_coverage.coverage(probs, chosen.to(self.device), count)))

    def fork(self, src, dst):
        n = int(self.lengths[src])
        for cache in (self.dense_k, self.dense_v, self.host_k, self.host_v):
            cache[:, dst, :, :n] = cache[:, src, :, :n]
        self.partial_k[:, dst, ..., :n] = self.partial_k[:, src, ..., :n]
        self.lengths[dst] = n
        self._book()

    def release(self, row):
        """The row is free for another request (both tiers keep its whole length reserved)."""
        self.lengths[row] = 0
        self._book()

    def after_pass(self, step: Step):
        self.lengths[step.rows] = step.start + step.q_len
        self._book()
        if step.phase == "decode":
            self.decode_steps += 1

    def _book(self):
        s = self.spec
        tokens = int(self.lengths.sum())
        per_layer = s.num_kv_heads * s.head_dim * s.dtype_bytes * 2
        sparse = s.num_layers - self.dense
        self.ledger.set("host", kv=tokens * sparse * per_layer,
                        kv_reserved=self.host_k.nbytes + self.host_v.nbytes - tokens * sparse * per_layer)
        self.ledger.set("device", "infinigen dense layers", kv=tokens * self.dense * per_layer,
                        kv_reserved=self.dense_k.nbytes + self.dense_v.nbytes - tokens * self.dense * per_layer)

    def stats(self):
        # what the work counter counts as leaving the host tier, where it is copied (read in place: nothing moves)
        moved = self.work.counts["decode"]["host_to_device_bytes"] if self.fetches else 0
        return {"bytes_moved_host_to_device": moved, "bytes_moved_per_step": moved / max(self.decode_steps, 1),
                **infinigen_coverage.summary(self.coverage),
                "transfer": ("pcie" if self.device.type == "cuda" else "host memory copy (no bus crossed)")
                if self.fetches else "read in place (host and device tiers are one memory)"}
