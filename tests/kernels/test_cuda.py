"""On a CUDA machine (skipped elsewhere): every policy's device paths, checked against the full cache.

The CPU suite cannot see a tensor left on the wrong device; these tests ran on a lent H100 (see README)."""

import pytest
import torch

from kvlib.engine import Engine
from kvlib.models import load_model
from kvlib.policies import make_policy

pytestmark = [pytest.mark.model, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# InfiniGen with every candidate and no cap: its speculation and fetches run, and select everything
CASES = [("paged", {}, "fused"), ("h2o", {"budget": 1.0}, "chunked"),
         ("infinigen", {"budget": 1.0, "alpha": 1e9}, "fused")]


@pytest.fixture(scope="module")
def smollm_cuda():
    # fp32: bf16 rounding differs between SDPA and the matrix attention H2O and InfiniGen use, and a near tie in the
    # greedy choice can then flip (seen on an H100 at the first generated token of one prompt)
    return load_model("smollm2-135m", device="cuda", dtype=torch.float32)


@pytest.mark.parametrize("name,settings,prefill", CASES)
def test_every_policy_at_full_budget_generates_what_full_generates_on_cuda(smollm_cuda, mixed_prompts, name,
                                                                          settings, prefill):
    ref = Engine(smollm_cuda, make_policy("full")).generate(mixed_prompts, 16, stop_at_eos=False)
    out = Engine(smollm_cuda, make_policy(name, **settings)).generate(mixed_prompts, 16, prefill_mode=prefill,
                                                                     stop_at_eos=False)
    assert [o["token_ids"] for o in out.outputs] == [o["token_ids"] for o in ref.outputs]


@pytest.mark.parametrize("name", ["h2o", "infinigen"])
def test_sparse_policies_under_a_small_budget_run_on_cuda(smollm_cuda, mixed_prompts, name):
    policy = make_policy(name, budget=0.3)
    result = Engine(smollm_cuda, policy).generate(mixed_prompts, 16, prefill_mode=policy.preferred_prefill,
                                                  stop_at_eos=False)
    assert all(len(o["token_ids"]) == 16 for o in result.outputs)
    assert result.memory["device"]["kv_bytes"] > 0


@pytest.mark.parametrize("name", ["full", "paged", "h2o", "infinigen"])
def test_the_ledger_books_what_cuda_allocated(smollm_cuda, name):
    """After every pass, the device bytes the ledger books for the policy equal what torch.cuda has allocated beyond
    the weights (within 2 %: the caching allocator rounds every tensor up to 512 bytes, and the pass's logits are
    still alive); the census of the policy's tensors agrees with both."""
    from test_booking import CASES as SETTINGS
    from test_booking import booked, census

    prompts = [list(range(1000 + 1000 * i, 1000 + 1000 * i + n)) for i, n in enumerate((1024, 700, 900))]
    policy = make_policy(name, **SETTINGS[name])
    engine = Engine(smollm_cuda, policy)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    records = []
    original = policy.after_pass

    def after_pass(step):
        original(step)
        torch.cuda.synchronize()
        records.append((torch.cuda.memory_allocated() - base, booked(engine.ledger)["device"], census(policy)["device"]))
    policy.after_pass = after_pass
    mode = "chunked" if "chunked" in policy.supported_prefill else "fused"
    engine.generate(prompts, 6, prefill_mode=mode, chunk_size=256, stop_at_eos=False)
    for allocated, ledger, held in records[-4:]:  # the decode passes: the whole cache is in
        assert ledger == pytest.approx(held, rel=0.01)
        assert ledger == pytest.approx(allocated, rel=0.02)
