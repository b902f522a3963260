"""Every runner of a profile's systems experiments projected onto a GPU shape, each from its policy's own settings and
code rather than a rule written here per name (kvlib.projection.paper_scale keeps its paper rules for full, paged, H2O
and InfiniGen; `kvlib choose --hardware` adds these beside them).

The policy is built from the profile's settings (kvlib.policies.make_policy; an outside engine from its backend) and given the published shape in
place of a loaded model's; what its decode step reads, computes and moves is then read from the methods the policy
runs with, and counted as kvlib.memory.work counts a run (per row and decode step, at the workload's mean length):
- a FlexGen placement (`placement`): its KV shares by tier; each layer's host and disk share loaded to the device
  every step and the new token stored back, in the records its `cache_arrays` stream (an H2O port's scores and
  positions with its keys and values); attention over what `held` (its kept set) or the whole row holds;
- Quest's pages (`pages_read`): its dense layers read every held token, the others the pages its budget allows, and
  every block's key bounds (2 x head_dim a block and KV head) are read and scored, as its attend counts them;
- KIVI's codes (`keys_quantized`, `values_quantized`, `token_bytes`): every token read, coded ones at their bytes;
- DuoAttention's heads (`ratio_for`): the share of retrieval heads its budget maps to read every held token, the
  others their ring of sink + window + 1;
- a kept set (`limits`: H2O, StreamingLLM, SnapKV, ...): the tokens kept at that length and the new token, with the
  probabilities read back (fp32) where the policy scores at decode (`decode_scores`);
- a lossless cache (full, paged, an outside engine's): every held token. An outside engine's work is not counted by
  kvlib; its step is counted as the dense read it must do, and said so.
A policy none of these describes gets a row that says it is not projected, and why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SCORE_BYTES = 4  # fp32 probabilities a scorer reads back per attended token (kvlib.memory.work)


class NotProjected(Exception):
    """A runner whose decode step kvlib cannot project honestly: the message says why."""


@dataclass(frozen=True)
class Rule:
    """What a policy's decode step does, read from the policy: its work and its memory at a workload."""

    work: dict  # one mean decode step's counts (kvlib.memory.work.QUANTITIES; missing ones are zero)
    kv_length: float  # tokens a sparse layer attends per row (the new one included)
    full_layers_share: float  # layers that attend every held token instead
    device_kv_bytes: float  # at the run's end (its peak)
    host_kv_bytes: float
    device_weight_share: float = 1.0  # of the weights (a FlexGen placement may put some on the host)
    kernels: bool = True  # aiconfigurator's bf16 kernels describe its attention
    note: str = ""  # said beside the row


def policy_at(name: str, settings: dict, shape):
    """The policy `name` with `settings`, given a published shape (kvlib.models.pass_shape.PassShape) as a loaded
    model's spec (what its methods read: head_dim, heads, layers, dtype); nothing is allocated."""
    import torch

    from kvlib.backends.vllm import VLLMBackend
    from kvlib.models.loading import ModelSpec
    from kvlib.policies import make_policy
    from kvlib.settings import construct

    outside = {VLLMBackend.name: VLLMBackend}  # kvlib.study.runners' outside engines
    policy = construct(outside[name], settings, "backend") if name in outside else make_policy(name, **settings)
    policy.spec = ModelSpec(name="a published shape", num_layers=shape.num_layers,
                            num_attention_heads=shape.num_attention_heads, num_kv_heads=shape.num_kv_heads,
                            head_dim=shape.head_dim, hidden_size=shape.num_attention_heads * shape.head_dim,
                            max_context=0, dtype={2: torch.bfloat16, 4: torch.float32}[shape.dtype_bytes])
    if hasattr(policy, "group_size") and hasattr(policy, "keys_quantized"):  # what KIVI's bind derives from the spec
        policy.value_group = min(policy.group_size, policy.spec.head_dim)
        policy.code_bits = policy.bits if policy.quantize else 8 * policy.spec.dtype_bytes
    return policy


@dataclass(frozen=True)
class At:
    """A workload at a shape, as each mechanism below reads it: rows of `prompt` tokens and `output` new ones."""

    shape: object  # kvlib.models.pass_shape.PassShape
    b: int  # rows
    prompt: int
    output: int
    scores: bool  # the policy reads attention probabilities back at decode

    @property
    def held(self) -> float:
        return self.prompt + (self.output + 1) / 2  # tokens a row holds at its mean decode step, the new one included

    @property
    def final(self) -> int:
        return self.prompt + self.output

    @property
    def per_token(self) -> int:
        return self.shape.num_kv_heads * self.shape.kv_token_bytes  # one layer's K and V of one token

    def dense_attention(self, attended: float, layers: int | None = None) -> dict:
        read = self.b * (self.shape.num_layers if layers is None else layers) * self.shape.num_kv_heads * attended
        return self.shape.attention_work(read, read * (self.shape.num_attention_heads // self.shape.num_kv_heads))

    def score_reads(self, attended: float) -> dict:
        read = self.b * self.shape.num_layers * self.shape.num_kv_heads * attended * SCORE_BYTES
        return {"select_read_bytes": read} if self.scores else {}

    def step(self, *work: dict) -> dict:
        """One decode step's pass (linears, norms) with the attention and the extra work given."""
        from kvlib.models.pass_shape import add

        return add(self.shape.pass_work(self.b, 1), *work)


def rule(policy, shape, batch: int, prompt: int, output: int) -> Rule:
    """The policy's decode step at the mean length of rows of `prompt` tokens and `output` new ones, and what it
    holds at their end (kvlib.projection.paper_scale.Workload's conventions): read by the first mechanism the policy
    has (MECHANISMS), else as a lossless cache."""
    at = At(shape, batch, prompt, output, bool(getattr(policy, "decode_scores", False)))
    for attribute, read in MECHANISMS:
        if hasattr(policy, attribute):
            return read(policy, at)
    if policy.lossless:
        return _every_token(policy, at)
    raise NotProjected(f"kvlib.projection.policy_step reads no rule for {policy.name}'s decode step from the "
                       f"policy: none of tiers, pages, codes, heads or a kept set")


def _tiers(policy, at: At) -> Rule:
    """FlexGen's placement: the off-device share of every streamed array loaded each step, the new token stored
    back; staging buffers on the device where anything is off it or coded."""
    shape, layers, kv_heads = at.shape, at.shape.num_layers, at.shape.num_kv_heads
    kv_dev, kv_host, kv_disk = policy.placement.kv
    w_dev, w_host, w_disk = policy.placement.weights
    arrays = policy.cache_arrays()
    record = sum(a.record_bytes for a in arrays)  # one token of one (row, KV head, layer), every array streamed
    attended = policy.held(int(at.held) - 1, at.prompt)[0] + 1 if hasattr(policy, "held") else at.held
    kept_final = policy.held(at.final, at.prompt)[0] if hasattr(policy, "held") else at.final
    off = kv_host + kv_disk
    loaded = at.b * layers * kv_heads * (attended - 1) * record * off  # what the step had stored, off the device
    stored = at.b * layers * kv_heads * record * off  # the new token's records back to their tiers
    moves = len(arrays) * layers if off else 0
    weights_off = shape.weight_bytes * (w_host + w_disk)
    work = at.step(at.dense_attention(attended), at.score_reads(attended), {
        "host_to_device_bytes": loaded + weights_off, "host_to_device_transfers": moves + (layers if weights_off else 0),
        "device_to_host_bytes": stored, "device_to_host_transfers": moves,
        "disk_to_host_bytes": (loaded / off * kv_disk if off else 0) + shape.weight_bytes * w_disk,
        "disk_to_host_transfers": (len(arrays) * layers if kv_disk else 0) + (layers if w_disk else 0),
        "host_to_disk_bytes": stored / off * kv_disk if off else 0,
        "host_to_disk_transfers": len(arrays) * layers if kv_disk else 0})
    capacity = policy.cache_capacity([at.prompt], at.output)
    staging = 0 if not off and not any(a.compress for a in arrays) else 2 * at.b * kv_heads * capacity * record
    held_records = at.b * layers * kv_heads * kept_final * record
    where = (f"its percent {policy.percent} puts {kv_host:.0%} of the KV on the host, {kv_disk:.0%} on disk: "
             f"each step loads that share over the link")
    return Rule(work, attended, 0.0, held_records * kv_dev + staging, held_records * kv_host, w_dev,
                note=where if off else "")


def _pages(policy, at: At) -> Rule:
    """Quest: its dense layers read every held token, the others its budget's pages and every block's key bounds."""
    shape, layers = at.shape, at.shape.num_layers
    dense = min(policy.dense_layers, layers)
    sparse = layers - dense
    attended = min(policy.pages_read(int(at.held)) * policy.block_size, at.held)
    blocks = at.b * math.ceil(at.held / policy.block_size)
    bounds = shape.num_kv_heads * 2 * shape.head_dim * shape.dtype_bytes  # a block's key min and max, per KV head
    work = at.step(at.dense_attention(at.held, dense), at.dense_attention(attended, sparse), {
        "select_read_bytes": sparse * blocks * bounds,
        "select_flops": sparse * 4 * blocks * shape.num_attention_heads * shape.head_dim})
    final_blocks = at.b * math.ceil(at.final / policy.block_size)
    return Rule(work, attended, dense / layers, at.b * at.final * layers * at.per_token + final_blocks * layers * bounds,
                0.0)


def _codes(policy, at: At) -> Rule:
    """KIVI: every token read, its coded ones at their bytes."""
    import torch

    def coded_bytes(n: float) -> float:  # one (row, KV head, layer)
        key, value, plain = policy.token_bytes()
        length = torch.tensor([round(n)])
        kq, vq = int(policy.keys_quantized(length)), int(policy.values_quantized(length))
        n = int(length)
        return kq * key + (n - kq) * plain + vq * value + (n - vq) * plain

    rows = at.b * at.shape.num_layers * at.shape.num_kv_heads
    work = at.step(at.dense_attention(at.held))
    work["kv_read_bytes"] = rows * coded_bytes(at.held)
    return Rule(work, at.held, 0.0, rows * coded_bytes(at.final), 0.0, kernels=False,
                note=f"{policy.bits}-bit codes read as they lie; no aiconfigurator estimate: its attention kernels "
                     f"read bf16")


def _heads(policy, at: At) -> Rule:
    """DuoAttention: its retrieval heads keep every entry, its streaming heads a ring of sink + window + 1."""
    from kvlib.policies.duo_heads import retrieval_count

    layers, kv_heads = at.shape.num_layers, at.shape.num_kv_heads
    share = retrieval_count(policy.ratio_for([at.prompt]), layers, kv_heads) / (layers * kv_heads)
    ring = policy.sink + policy.window + 1

    def kept(n: float) -> float:  # per (row, layer, KV head), mean over the heads
        return share * n + (1 - share) * min(n, ring)

    return Rule(at.step(at.dense_attention(kept(at.held))), kept(at.held), 0.0,
                at.b * kept(at.final) * layers * at.per_token, 0.0,
                note=f"{share:.0%} of its heads keep every entry (its budget's mapping; which ones is calibrated, "
                     f"not how many)")


def _kept_set(policy, at: At) -> Rule:
    """A kept set (H2O, StreamingLLM, SnapKV, ...): the entries kept at that length and the new token beside them."""
    attended = policy.limits(int(at.held), at.prompt)[0] + 1
    return Rule(at.step(at.dense_attention(attended), at.score_reads(attended)), attended, 0.0,
                at.b * policy.limits(at.final, at.prompt)[0] * at.shape.num_layers * at.per_token, 0.0)


def _every_token(policy, at: At) -> Rule:
    """A lossless cache (full, paged, an outside engine's): every held token."""
    note = ""
    if getattr(policy, "outside", False):
        note = (f"{policy.name}'s own engine, whose work kvlib does not count: its step is counted as the dense read "
                f"of every held token; it preallocates its KV pool from the memory it is given")
    return Rule(at.step(at.dense_attention(at.held)), at.held, 0.0, at.b * at.final * at.shape.num_layers * at.per_token,
                0.0, note=note)


# what a policy has, in the order read (a FlexGen port of H2O has tiers and a kept set: its tiers describe its step)
MECHANISMS = (("placement", _tiers), ("pages_read", _pages), ("keys_quantized", _codes), ("ratio_for", _heads),
              ("limits", _kept_set))
