"""InfiniGen's accuracy rule as its lm-eval harness applies it (snu-comparch/InfiniGen@3754f52
accuracy/src/modeling_llama_ours.py, `LlamaAttention.kv_cache_mask` and the speculation in `forward`, the hand-off in
`LlamaModel.forward`): one pass over context and continuation (accuracy/lm_eval/run_lm_eval_harness.py, one request a
batch), each query row of a sparse layer masked.

Speculation: layer l's approximate logits come from layer l-1's attention input (after input_layernorm) times layer
l's query weights, RoPE, the skewing matrix, only the partial columns kept, against layer l's keys skewed, over
sqrt(D). Layers 0 and 1 are dense (the hand-off starts at layer 1's input, for layer 2). Over a sequence of T tokens,
with fetch_max = int(budget x T) (the `capacity` of 1.0 every official script uses leaves no eviction):
- threshold of query row i: the first head's largest approximate logit of the row, minus alpha (`[0][0]` takes head 0
  of the flattened batch x heads; the harness runs one request a batch, kvlib each batch row's own head 0);
- candidates of a head at row i: its approximate logits >= that threshold, over all T keys (those above the diagonal
  carry -10000, so they count only where alpha is unbounded);
- fetch_num(i) = int(mean over heads of the candidates), in half precision, at most fetch_max;
- rows before fetch_max attend every earlier key; from row fetch_max on each head attends its own fetch_num(i)
  best-scored keys of keys 0..i; a row whose fetch_num is 0 masks every key alike, which attends them all.
The official code is multi-head, one skewing matrix per head; under grouped-query attention kvlib's matrix and partial
columns are the KV head's (kvlib.policies.infinigen_skew), and the choice is still each query head's own: a one-pass
mask shares no cache between the heads of a group. The first `dense_layers` layers are dense (the official 2 by
default). One numerical departure: the official mask adds -10000 to the logits in half precision, so a row whose count
is 0 attends every key with its logits rounded to multiples of 8; kvlib's driver attends such a row exactly.
"""

from __future__ import annotations

import contextlib

import torch

from kvlib.errors import UserError
from kvlib.policies.fidelity import Rule

# the candidates under either protocol: the accuracy code's per query row (its one pass), the speedup code's per head
CANDIDATES = ("the accuracy code (one pass): >= the first head's max - alpha, one threshold a query row; the speedup "
              "code (decode steps): > its head's max - alpha")


def by_protocol(rule: str, official: str, decode: str, why: str) -> tuple[Rule, Rule]:
    """A fidelity rule of the official one pass: kvlib's one-pass protocol does as it does; its decode steps
    (the deployed protocol, kvlib.evaluation.lm) `decode`, departing for `why`."""
    return (Rule(f"{rule} (one pass)", official, kvlib=official),
            Rule(f"{rule} (decode steps)", official, kvlib=decode, differs=why))


def keep_mask(approx: torch.Tensor, alpha: float, budget: float) -> torch.Tensor:
    """What each query row attends, bool [B, H, T, T], from the approximate logits [B, H, T, T] (-inf above the
    diagonal; the caller applies the causal mask)."""
    t = approx.shape[-1]
    fetch_max = int(t * budget)
    keep = torch.ones_like(approx, dtype=torch.bool)
    if fetch_max == 0:  # every row's count is capped at 0: every row attends everything
        return keep
    threshold = approx[:, :1].amax(dim=-1, keepdim=True) - alpha  # [B, 1, T, 1]: head 0's, for every head
    counts = (approx >= threshold).sum(dim=-1)  # [B, H, T]
    # the official mean is taken in the model's half precision before truncating: its rounding kept
    fetch = counts.to(torch.float16).mean(dim=1).to(torch.int32).clamp(max=fetch_max)  # [B, T]
    tail = approx[:, :, fetch_max:]  # rows past fetch_max have more than fetch_max keys, none -inf among the top
    order = tail.topk(fetch_max, dim=-1).indices  # [B, H, T - fetch_max, fetch_max], best first
    wanted = fetch[:, None, fetch_max:, None]
    first = torch.arange(fetch_max, device=approx.device) < wanted
    chosen = torch.zeros_like(tail, dtype=torch.bool).scatter_(-1, order, first.expand_as(order))
    keep[:, :, fetch_max:] = chosen | (wanted == 0)
    return keep


def speculated_logits(policy, layer: int, hidden: torch.Tensor, position_embeddings, key: torch.Tensor
                      ) -> torch.Tensor:
    """Layer `layer`'s approximate logits [B, Hq, T, T] (-inf above the diagonal): layer-1's attention input
    `hidden` [B, T, hidden] through this layer's query projection and RoPE, against its keys [B, Hkv, T, D], both
    skewed and cut to the partial columns (kvlib's skew_cut: A's kept columns, so the product is the official
    zeroed-column one)."""
    q = policy.queries[layer](hidden, position_embeddings)  # [B, Hq, T, D]
    b, hq, t, d = q.shape
    hkv = key.shape[1]
    cut = policy.skew_cut[layer].to(q.dtype)  # [Hkv, D, r]
    q_part = torch.matmul(q.reshape(b, hkv, hq // hkv, t, d), cut[:, None])  # [B, Hkv, G, T, r]
    k_part = torch.matmul(key.to(q.dtype), cut)  # [B, Hkv, T, r]
    approx = torch.matmul(q_part, k_part[:, :, None].transpose(-1, -2)).reshape(b, hq, t, t) * policy.scale
    causal = torch.ones(t, t, dtype=torch.bool, device=approx.device).tril()
    return approx.masked_fill(~causal, float("-inf"))


def dense_layers(policy) -> int:
    return min(policy.dense_layers, policy.spec.num_layers)


def keep_for(policy, layer: int, query: torch.Tensor, key: torch.Tensor, scores: torch.Tensor) -> torch.Tensor | None:
    """InfiniGenPolicy.one_pass_keep: None on a dense layer (it attends everything); a sparse layer's mask from the
    previous layer's input the session captured in this pass (the true `query` and `scores` are not read)."""
    if layer < dense_layers(policy):
        return None
    inputs = getattr(policy, "one_pass_inputs", None)
    if inputs is None or layer - 1 not in inputs:
        raise UserError("infinigen's one-pass mask needs the previous layer's attention input: run the pass inside "
                        "policy.one_pass_session() (kvlib.evaluation.one_pass does)")
    hidden, position_embeddings = inputs.pop(layer - 1)
    approx = speculated_logits(policy, layer, hidden, position_embeddings, key)
    return keep_mask(approx, policy.alpha, policy.budget)


def _owner(one_pass):
    return one_pass[0] if isinstance(one_pass, tuple) else one_pass  # the driver passes (policy, counter)


@contextlib.contextmanager
def session(policy):
    """InfiniGenPolicy.one_pass_session: forward pre-hooks on the attention modules whose input speculates a sparse next layer: each keeps, for the
    pass that names this policy, the module's input and position embeddings until the next layer's mask reads them
    (layer i's hook fires before layer i+1's attention)."""
    policy.one_pass_inputs = {}

    def capture(layer: int):
        def hook(module, args, kwargs):
            if _owner(kwargs.get("one_pass")) is policy:
                policy.one_pass_inputs[layer] = (kwargs["hidden_states"], kwargs["position_embeddings"])
        return hook

    hooks = [policy.attn_modules[i].register_forward_pre_hook(capture(i), with_kwargs=True)
             for i in range(max(dense_layers(policy) - 1, 0), len(policy.attn_modules) - 1)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        policy.one_pass_inputs = None
