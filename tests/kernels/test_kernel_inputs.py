"""Every C entry point refuses malformed input with one ValueError naming the argument, never a crash: the cases of
tests/kernels/kernel_cases.py (each class of malformed argument for each entry point: wrong ranks, zero sizes,
negative and too-large indices, overflowing indices, mismatched heads, groups and head dims, non-contiguous views,
wrong dtypes, tensors on another device) run in a subprocess, so a crash fails its case instead of ending the run. Under
KVLIB_CPU_KERNELS_SANITIZE=1 and the ASan runtime (tests/kernels/test_kernel_sanitizers.py) the subprocess inherits
both.

Also: what a wrapper checks is what the C reads (index tensors are copied), cos and sin broadcast over the batch as
PyTorch's rotation does, and a NaN coded by KIVI's store leaves its neighbours' codes alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_cases import BROKEN, CASES, VALID, decode_call, kivi_call  # tests/ is on sys.path, as for ray_fakes

from kvlib.kernels import cpu_kernel

needs_kernel = pytest.mark.skipif(not cpu_kernel.available(), reason="no C compiler: the kernel is not built")
SCRIPT = Path(__file__).parent / "kernel_cases.py"


@pytest.fixture(scope="module")
def outcomes() -> dict:
    """Each case's outcome, the cases run in one subprocess that is started again past any case that crashed it."""
    results, left = {}, list(CASES)
    root = Path(__file__).parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    while left:
        done = subprocess.run([sys.executable, str(SCRIPT), *left], capture_output=True, text=True, env=env,
                              cwd=root, timeout=600, check=False)
        for line in done.stdout.splitlines():
            if line.startswith("{"):
                result = json.loads(line)
                results[result["case"]] = result
        left = [name for name in left if name not in results]
        if left:  # the first case without a line is the one that crashed
            results[left.pop(0)] = {"raised": "crash", "message": f"exit {done.returncode}: {done.stderr[-3000:]}"}
    return results


@needs_kernel
@pytest.mark.parametrize("case", list(VALID))
def test_the_valid_calls_run(outcomes, case):
    assert outcomes[case]["raised"] is None, outcomes[case]


@needs_kernel
@pytest.mark.parametrize("case", [f"{entry}: {what}" for entry, what, _ in BROKEN])
def test_malformed_input_is_refused_with_a_value_error(outcomes, case):
    result = outcomes[case]
    assert result["raised"] == "ValueError", result
    assert result["message"].startswith(("decode", "quest_select", "infinigen_select", "kivi_store", "add_rms_norm",
                                         "rope_", "silu_mul")), result  # a wrapper's check said it, not the C's code


def test_every_entry_point_has_malformed_cases():
    entries = {entry for entry, _, _ in BROKEN}
    assert entries == {"decode", "quantized decode", "quest_select", "infinigen_select", "kivi_store",
                       "add_rms_norm", "rope_", "silu_mul"}


@needs_kernel
def test_what_is_checked_is_a_copy_the_caller_cannot_change():
    """The index tensors the C reads are the checked copies: the caller's lengths are not what the kernel reads."""
    from kvlib.kernels import checks

    call = decode_call()
    lib = cpu_kernel._library()
    c = checks.check_decode(lib, **{k: call[k] for k in ("query", "keys", "values", "row_offset", "table", "lengths",
                                                         "block_size", "head_stride", "scale")},
                            per_head_table=False, quantized=None, rows=None)
    for name in ("lengths", "table", "row_offset"):
        assert getattr(c, name).data_ptr() != call[name].data_ptr()
        torch.testing.assert_close(getattr(c, name), call[name])


@needs_kernel
def test_rope_with_cos_broadcast_over_the_batch_equals_pytorch():
    x = torch.randn(3, 2, 64)
    cos, sin = torch.rand(1, 2, 32), torch.rand(1, 2, 32)
    want = x.clone().view(3, 2, 2, 32)
    rotated = torch.cat([-want[..., 16:], want[..., :16]], dim=-1)
    want = (want * cos[:, :, None] + rotated * sin[:, :, None]).view(3, 2, 64)
    cpu_kernel.rope_(x, 2, 32, cos, sin)
    torch.testing.assert_close(x, want)


@needs_kernel
def test_a_nan_codes_zero_and_leaves_its_neighbours_codes_alone():
    """A value ring token whose channel 1 is NaN codes that channel 0 (code_of); the byte's other codes are those of
    the same token with channel 1 at its group's minimum (which codes 0 and leaves the group's range as it is)."""
    stored = []
    for nan in (True, False):
        call = kivi_call()
        torch.manual_seed(1)
        ring = torch.randn(call["value_ring"].shape)
        ring[0, :, 3, 1] = float("nan") if nan else ring[0, :, 3, [0, *range(2, 8)]].min(-1).values
        call["value_ring"].copy_(ring)
        call["begin"] = torch.tensor([11, 9])  # row 0's token 11 pushes token 3 (slot 3) out of the ring
        cpu_kernel.kivi_store(**call)
        stored.append(call["coded"].value_codes[0, :, 3].clone())
    assert torch.equal(stored[0], stored[1])
