"""KIVI's decode-step store in C (kvlib.kernels.cpu_kernel.kivi_store) against the PyTorch path it replaces on a CPU
(KIVIPolicy._store_token): byte for byte the same rings, codes, scales and zero points, over random batches whose
rows push a value out of the ring, fill the key ring, or neither; and its refusals."""

import random

import pytest
import torch

from kvlib.kernels import cpu_kernel
from kvlib.memory.ledger import MemoryLedger
from kvlib.memory.timing import Timers
from kvlib.models.loading import ModelSpec
from kvlib.policies import make_policy
from kvlib.policies.kivi import CACHES

needs_kernel = pytest.mark.skipif(not cpu_kernel.available(), reason="no C compiler: the kernel is not built")


def started_policy(rng: random.Random, bits: int, quantize: bool):
    """A KIVI policy holding random caches for a few cache rows of a 2-layer model."""
    group = rng.choice([4, 8, 16, 32])
    residual = group * rng.choice([1, 2, 4])
    kv_heads, head_dim = rng.choice([1, 2, 3]), rng.choice([16, 32, 64])
    policy = make_policy("kivi", bits=bits, group_size=group, residual=residual, quantize=quantize)
    policy.spec = ModelSpec("case", 2, kv_heads, kv_heads, head_dim, 0, 0, torch.float32)
    # what bind() sets, without a model
    policy.ledger, policy.timers, policy.device, policy.serving_bytes = MemoryLedger(), Timers("cpu"), "cpu", None
    policy.value_group = min(group, head_dim)
    policy.code_bits = bits if quantize else 32
    rows = rng.randint(1, 5)
    policy.start(rows, [residual * rng.randint(1, 4)] * rows, residual)
    for name in CACHES:
        cache = getattr(policy, name)
        if cache.dtype == torch.uint8:
            cache.random_(0, 256)
        else:  # some values far apart, some equal (a zero range)
            cache.copy_(torch.randn(cache.shape) * rng.choice([1e-3, 1.0, 1e3]))
            cache.view(-1)[::7] = 0.5
    return policy


def store(policy, kernel, layer, rows, begin, key, value):
    """Every cache after one store on a copy of the policy's caches."""
    saved = {name: getattr(policy, name).clone() for name in CACHES}
    policy.decode_kernel = kernel
    policy._store_token(layer, rows, begin, key, value)
    after = {name: getattr(policy, name).clone() for name in CACHES}
    for name, cache in saved.items():
        setattr(policy, name, cache)
    return after


@needs_kernel
@pytest.mark.parametrize("bits,quantize", [(2, True), (4, True), (8, True), (16, True), (2, False)])
@pytest.mark.parametrize("seed", range(8))
def test_the_c_store_equals_the_pytorch_path(bits, quantize, seed):
    rng = random.Random(seed * 10 + bits)
    policy = started_policy(rng, bits, quantize)
    n_rows, kv_heads, capacity = policy.value_codes.shape[1], policy.spec.num_kv_heads, policy.value_codes.shape[3]
    r, d = policy.residual, policy.spec.head_dim
    for _ in range(6):
        batch = rng.randint(1, n_rows)
        rows = torch.tensor(rng.sample(range(n_rows), batch))
        begin = torch.tensor([rng.choice([0, r - 1, r, rng.randint(0, capacity - 1), capacity - 1])
                              for _ in range(batch)])
        # the new tokens as the model hands them: views into a wider projection, heads contiguous
        fused = torch.randn(batch, 3, kv_heads, d) * rng.choice([1e-2, 1.0, 30.0])
        key, value = fused[:, 1], fused[:, 2]
        layer = rng.randint(0, 1)
        got, want = (store(policy, k, layer, rows, begin, key, value) for k in ("c", "torch"))
        for name in CACHES:
            assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), (name, seed)
        filled = (begin % r == r - 1).sum()
        assert filled == 0 or not torch.equal(got["key_codes"], policy.key_codes), "no key group was coded"


@needs_kernel
def test_the_c_store_refuses_what_it_cannot_write():
    policy = started_policy(random.Random(0), 2, True)
    n_rows, kv_heads, capacity = policy.value_codes.shape[1], policy.spec.num_kv_heads, policy.value_codes.shape[3]
    key = torch.zeros(1, kv_heads, policy.spec.head_dim)
    policy.decode_kernel = "c"
    for rows, begin in (([n_rows], [0]), ([-1], [0]), ([0], [capacity]), ([0], [-1])):
        with pytest.raises(ValueError, match="rows or begin: a row past the cache"):
            policy._store_token(0, torch.tensor(rows), torch.tensor(begin), key, key)
    with pytest.raises(ValueError, match="key must be torch.float32"):
        policy._store_token(0, torch.tensor([0]), torch.tensor([0]), key.double(), key.double())
    with pytest.raises(ValueError, match="key's rows must each hold"):  # channels not contiguous
        wide = torch.zeros(1, kv_heads, 2 * policy.spec.head_dim)[..., ::2]
        policy._store_token(0, torch.tensor([0]), torch.tensor([0]), wide, wide)
