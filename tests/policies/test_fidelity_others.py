"""Quest, DuoAttention and KIVI against their official rules, each re-stated here from the official code on small
inputs (not by calling kvlib), and the fidelity entries of full, paged, streaming, duo, quest and kivi."""

import numpy as np
import pytest
import torch

from kvlib.engine import Engine
from kvlib.policies import duo_heads, make_policy
from kvlib.policies.registry import REGISTRY

MINE = ("full", "paged", "streaming", "duo", "quest", "kivi")


def quest_pages(seen: int, token_budget: int, page_size: int) -> int:
    """Quest's kernels (quest/models/llama.py, quest/utils/controller.py): a page budget of token_budget // page_size
    pages, the last page one of them; a row with no more pages than that is read whole."""
    pages = -(-seen // page_size)
    page_budget = token_budget // page_size
    return pages if pages <= page_budget else max(page_budget, 1)


def test_quest_reads_the_official_page_budget(tiny, kernel):
    """At budget 0.3 the token budget is rarely a whole number of 4-token pages: the official floor, not a ceiling."""
    torch.manual_seed(3)
    bs, budget = 4, 0.3
    prompts = [torch.randint(100, 5000, (n,)).tolist() for n in (45, 22)]
    policy = make_policy("quest", budget=budget, block_size=bs, dense_layers=1)
    reads = []
    choose = policy.choose_blocks

    def recording(layer, query):
        table, lengths = choose(layer, query)
        reads.append((policy.seen.tolist(), lengths.tolist()))
        return table, lengths
    policy.choose_blocks = recording
    Engine(tiny, policy).generate(prompts, 7, prefill_mode="fused", stop_at_eos=False)
    assert reads
    floored = 0
    for seen, lengths in reads:
        for n, per_head in zip(seen, lengths):
            token_budget = min(n, max(1, round(budget * n)))  # kvlib's budget rule (a stated departure)
            pages = quest_pages(n, token_budget, bs)
            last = n - (-(-n // bs) - 1) * bs  # tokens in the row's last page
            assert per_head == [(pages - 1) * bs + last] * len(per_head), (n, token_budget)
            floored += token_budget % bs != 0
    assert floored  # the case that tells a floor from a ceiling was met


def official_retrieval_mask(gates: np.ndarray, sparsity: float) -> np.ndarray:
    """duo_attn/utils.py sparsify_attention_heads (its 1e-6 tie-breaking noise left out: these gates are distinct)."""
    threshold = np.quantile(gates, sparsity)
    if sparsity >= 1:
        threshold = 2
    if sparsity <= 0:
        threshold = -1
    return gates >= threshold


@pytest.mark.parametrize("shape, sparsity", [((5, 2), 0.25), ((30, 3), 0.75), ((4, 2), 0.5), ((3, 3), 0.9),
                                             ((6, 4), 0.0), ((6, 4), 1.0), ((7, 3), 0.3)])
def test_duo_takes_as_many_retrieval_heads_as_the_official_quantile(shape, sparsity):
    gates = np.random.default_rng(11).permutation(np.arange(1, np.prod(shape) + 1)).reshape(shape) / 1000
    want = official_retrieval_mask(gates, sparsity)
    got = duo_heads.choose_retrieval(torch.tensor(gates), 1 - sparsity).numpy()
    assert got.sum() == want.sum()
    assert (got == want).all()


def test_duo_streaming_heads_keep_the_official_recent_window():
    """The official recent_size (duo_attn/utils.py, README's enable_duo_attention_eval) is 256."""
    assert make_policy("duo").window == 256


def test_kivi_attends_a_key_residual_that_fills_in_full_precision(tiny, kernel):
    """models/llama_kivi.py, at decode: the new key joins key_states_full, attention runs, and only then is a
    residual_length-long key_states_full quantized. So a step over n tokens reads as codes the keys coded before it:
    (n - 1) // residual x residual of them."""
    torch.manual_seed(4)
    residual, prompt_len = 8, 13
    policy = make_policy("kivi", bits=2, group_size=4, residual=residual)
    counts = []
    attend = policy.decode_attention

    def recording(layer, query, reads):
        counts.append((reads.lengths.tolist(), reads.quantized.keys_quantized.tolist()))
        return attend(layer, query, reads)
    policy.decode_attention = recording
    prompt = torch.randint(100, 5000, (prompt_len,)).tolist()
    Engine(tiny, policy).generate([prompt], 14, prefill_mode="fused", stop_at_eos=False)
    fills = 0
    for lengths, coded in counts:
        n = int(torch.tensor(lengths).max())  # every KV head reads the row's n tokens
        assert coded == [(n - 1) // residual * residual], n
        fills += n % residual == 0
    assert fills == 2 * tiny.spec.num_layers  # n = 16 and 24: each layer's step that fills the residual


def minmax(x: torch.Tensor, dim: int, bits: int = 2) -> torch.Tensor:
    """quant/new_pack.py: scale (max - min) / (2^bits - 1), codes round(clamp((x - min) / scale)), dequantized."""
    low, high = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    scale = (high - low) / (2 ** bits - 1)
    return ((x - low) / scale).clamp(0, 2 ** bits - 1).round() * scale + low


def test_kivi_step_that_fills_the_key_residual_matches_a_restated_attention(tiny):
    """The output of that step: keys coded before it per channel over 4-token groups, the rest (the residual that
    just filled) in full precision; values coded per token over 4-channel groups but the last `residual` (kvlib's
    stated departure, one value early)."""
    torch.manual_seed(5)
    residual, group, spec = 8, 4, tiny.spec
    policy = make_policy("kivi", bits=2, group_size=group, residual=residual)
    raw, checked = {}, []
    attend, decode = policy.attend, policy.decode_attention

    def recording_attend(layer, query, key, value, step):
        old = raw.get(layer, (key[:, :, :0], value[:, :, :0]))
        raw[layer] = (torch.cat([old[0], key], dim=2), torch.cat([old[1], value], dim=2))
        return attend(layer, query, key, value, step)

    def checking_decode(layer, query, reads):
        out = decode(layer, query, reads)
        keys, values = (x[0] for x in raw[layer])  # [Hkv, n, D]
        n = keys.shape[1]
        if n % residual == 0:
            coded = (n - 1) // residual * residual
            k = keys.clone()
            k[:, :coded] = minmax(keys[:, :coded].reshape(spec.num_kv_heads, -1, group, spec.head_dim), dim=2
                                  ).reshape(spec.num_kv_heads, coded, spec.head_dim)
            v = values.clone()
            v[:, :n - residual] = minmax(values[:, :n - residual].reshape(spec.num_kv_heads, n - residual, -1, group),
                                         dim=3).reshape(spec.num_kv_heads, n - residual, spec.head_dim)
            q = query[0, :, 0].view(spec.num_kv_heads, -1, spec.head_dim)  # [Hkv, G, D]
            weights = torch.softmax(q @ k.transpose(1, 2) * spec.head_dim ** -0.5, dim=-1)
            want = (weights @ v).reshape(-1, spec.head_dim)
            torch.testing.assert_close(out[0][0, :, 0], want, rtol=1e-4, atol=1e-5)
            checked.append(n)
        return out
    policy.attend, policy.decode_attention = recording_attend, checking_decode
    prompt = torch.randint(100, 5000, (13,)).tolist()
    Engine(tiny, policy).generate([prompt], 12, prefill_mode="fused", stop_at_eos=False)
    assert checked == [16] * spec.num_layers + [24] * spec.num_layers


@pytest.mark.parametrize("name", MINE)
def test_each_policy_declares_its_own_fidelity(name):
    from kvlib.policies import fidelity  # (imported here: the rules' tests above run without the table)

    cls = REGISTRY[name]
    assert "fidelity" in cls.__dict__
    table = fidelity.rows({name: cls})
    assert table and all(r["verdict"] == "same" or r["verdict"].startswith("differs: ") for r in table)


def test_changed_defaults_read_same():
    from kvlib.policies import fidelity

    verdicts = {(r["policy"], r["rule"]): r["verdict"] for r in fidelity.rows({n: REGISTRY[n] for n in MINE})}
    assert verdicts[("duo", "recent tokens")] == "same"
    assert verdicts[("duo", "how many")] == "same"
    assert verdicts[("quest", "pages read")] == "same"
    assert verdicts[("kivi", "a key residual that fills")] == "same"
