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


def rule(policy, shape, batch: int, prompt: int, output: int) -> Rule:
    """The policy's decode step at the mean length of rows of `prompt` tokens and `output` new ones, and what it
    holds at their end (kvlib.projection.paper_scale.Workload's conventions)."""
    from kvlib.models.pass_shape import add

    b, held = batch, prompt + (output + 1) / 2
    final = prompt + output
    layers, kv_heads = shape.num_layers, shape.num_kv_heads
    group = shape.num_attention_heads // kv_heads
    per_token = kv_heads * shape.kv_token_bytes  # one layer's K and V of one token
    scores = bool(getattr(policy, "decode_scores", False))

    def dense_attention(attended: float, layer_count: int = layers) -> dict:
        read = b * layer_count * kv_heads * attended
        return shape.attention_work(read, read * group)

    def score_reads(attended: float) -> dict:
        return {"select_read_bytes": b * layers * kv_heads * attended * SCORE_BYTES} if scores else {}

    if hasattr(policy, "placement"):  # FlexGen's tiers
        kv_dev, kv_host, kv_disk = policy.placement.kv
        w_dev, w_host, w_disk = policy.placement.weights
        arrays = policy.cache_arrays()
        record = sum(a.record_bytes for a in arrays)  # one token of one (row, KV head, layer), every array streamed
        attended = policy.held(int(held) - 1, prompt)[0] + 1 if hasattr(policy, "held") else held
        kept_final = policy.held(final, prompt)[0] if hasattr(policy, "held") else final
        off = kv_host + kv_disk
        loaded = b * layers * kv_heads * (attended - 1) * record * off  # what the step had stored, off the device
        stored = b * layers * kv_heads * record * off  # the new token's records back to their tiers
        moves = len(arrays) * layers if off else 0
        weights_off = shape.weight_bytes * (w_host + w_disk)
        work = add(shape.pass_work(b, 1), dense_attention(attended), score_reads(attended), {
            "host_to_device_bytes": loaded + weights_off, "host_to_device_transfers": moves + (layers if weights_off else 0),
            "device_to_host_bytes": stored, "device_to_host_transfers": moves,
            "disk_to_host_bytes": (loaded / off * kv_disk if off else 0) + shape.weight_bytes * w_disk,
            "disk_to_host_transfers": (len(arrays) * layers if kv_disk else 0) + (layers if w_disk else 0),
            "host_to_disk_bytes": stored / off * kv_disk if off else 0,
            "host_to_disk_transfers": len(arrays) * layers if kv_disk else 0})
        capacity = policy.cache_capacity([prompt], output)
        staging = 0 if not off and not any(a.compress for a in arrays) else 2 * b * kv_heads * capacity * record
        held_records = b * layers * kv_heads * kept_final * record
        where = (f"its percent {policy.percent} puts {kv_host:.0%} of the KV on the host, {kv_disk:.0%} on disk: "
                 f"each step loads that share over the link")
        return Rule(work, attended, 0.0, held_records * kv_dev + staging, held_records * kv_host, w_dev,
                    note=where if off else "")
    if hasattr(policy, "pages_read"):  # Quest's pages
        dense = min(policy.dense_layers, layers)
        sparse = layers - dense
        attended = min(policy.pages_read(int(held)) * policy.block_size, held)
        blocks = b * math.ceil(held / policy.block_size)
        bounds = kv_heads * 2 * shape.head_dim * shape.dtype_bytes  # a block's key min and max, per KV head
        work = add(shape.pass_work(b, 1), dense_attention(held, dense), dense_attention(attended, sparse), {
            "select_read_bytes": sparse * blocks * bounds,
            "select_flops": sparse * 4 * blocks * shape.num_attention_heads * shape.head_dim})
        final_blocks = b * math.ceil(final / policy.block_size)
        return Rule(work, attended, dense / layers, b * final * layers * per_token + final_blocks * layers * bounds,
                    0.0)
    if hasattr(policy, "keys_quantized"):  # KIVI's codes
        import torch

        def coded_bytes(n: float) -> float:
            key, value, plain = policy.token_bytes()
            length = torch.tensor([round(n)])
            kq, vq = int(policy.keys_quantized(length)), int(policy.values_quantized(length))
            n = int(length)
            return kq * key + (n - kq) * plain + vq * value + (n - vq) * plain  # one (row, KV head, layer)

        work = add(shape.pass_work(b, 1), dense_attention(held))
        work["kv_read_bytes"] = b * layers * kv_heads * coded_bytes(held)
        return Rule(work, held, 0.0, b * layers * kv_heads * coded_bytes(final), 0.0, kernels=False,
                    note=f"{policy.bits}-bit codes read as they lie; no aiconfigurator estimate: its attention "
                         f"kernels read bf16")
    if hasattr(policy, "ratio_for"):  # DuoAttention's heads: retrieval heads keep every entry, streaming a ring
        from kvlib.policies.duo_heads import retrieval_count

        share = retrieval_count(policy.ratio_for([prompt]), layers, kv_heads) / (layers * kv_heads)
        ring = policy.sink + policy.window + 1

        def kept(n: float) -> float:  # per (row, layer, KV head), mean over the heads
            return share * n + (1 - share) * min(n, ring)

        work = add(shape.pass_work(b, 1), dense_attention(kept(held)))
        return Rule(work, kept(held), 0.0, b * kept(final) * layers * per_token, 0.0,
                    note=f"{share:.0%} of its heads keep every entry (its budget's mapping; which ones is "
                         f"calibrated, not how many)")
    if hasattr(policy, "limits"):  # a kept set
        attended = policy.limits(int(held), prompt)[0] + 1  # the kept entries and the new token beside them
        work = add(shape.pass_work(b, 1), dense_attention(attended), score_reads(attended))
        return Rule(work, attended, 0.0, b * policy.limits(final, prompt)[0] * layers * per_token, 0.0)
    if policy.lossless:
        work = add(shape.pass_work(b, 1), dense_attention(held))
        note = ""
        if getattr(policy, "outside", False):
            note = (f"{policy.name}'s own engine, whose work kvlib does not count: its step is counted as the "
                    f"dense read of every held token; it preallocates its KV pool from the memory it is given")
        return Rule(work, held, 0.0, b * final * layers * per_token, 0.0, note=note)
    raise NotProjected(f"kvlib.projection.policy_step reads no rule for {policy.name}'s decode step from the "
                       f"policy: none of tiers, pages, codes, heads or a kept set")
