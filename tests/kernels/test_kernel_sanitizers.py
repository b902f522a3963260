"""The C kernels under AddressSanitizer and UndefinedBehaviorSanitizer: the randomized tests of every entry point
(decode attention over every layout and over coded tokens, Quest's and InfiniGen's selections, KIVI's store, the
layer ops against PyTorch's; the narrowest vector path's build as well) and the
malformed inputs of tests/kernels/kernel_cases.py run in a subprocess with the ASan runtime preloaded and kvlib
loading its sanitized build (KVLIB_CPU_KERNELS_SANITIZE=1, a cache entry of its own). Any report fails the test:
ASan aborts on its first, UBSan is built not to recover, and the output is searched for either's report besides."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlib.kernels import library

ROOT = Path(__file__).parents[2]
# the randomized tests of each entry point (the engine-level ones load a model: minutes under ASan, and they reach the
# same entry points), and the malformed inputs
SANITIZED = ["tests/kernels/test_kernel_inputs.py", "tests/kernels/test_decode_attention.py",
             "tests/policies/test_quest_select.py", "tests/policies/test_infinigen_select.py",
             "tests/policies/test_kivi_store.py", "tests/kernels/test_cpu_kernel.py",
             *(f"tests/models/test_llama_forward.py::{test}" for test in ("test_add_rms_norm", "test_silu_mul",
                                                                          "test_rope_on_the_query_and_key_heads_only"))]
NOT_UNDER_SANITIZERS = "not tiny and not every_policy and not engine and not without_a_compiler"
# three of the eight seeds of decode's reference test (96 random cases over every layout): its float64 reference in
# Python, not the kernel, is what the other five would spend a minute on
DESELECTED = [f"tests/kernels/test_decode_attention.py::"
              f"test_the_c_kernel_and_the_pytorch_path_equal_a_plain_reference[{seed}]" for seed in range(5)]
# the narrowest vector path too (csrc/vectors.h), where this CPU runs it: its own loads and stores of codes and parts
NARROW = ("tests/kernels/test_kernel_paths.py::"
          "test_each_path_gives_the_bits_of_every_build_that_rounds_as_it_does[portable+fma]")
REPORTS = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer", "UndefinedBehaviorSanitizer")


def asan_runtime() -> str | None:
    """The compiler's shared ASan runtime, or None where it has none."""
    cc = library.compiler()
    if not cc:
        return None
    try:
        found = subprocess.run([*cc, "-print-file-name=libasan.so"], capture_output=True, text=True, timeout=60,
                               check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return found if found and os.path.isabs(found) and os.path.exists(found) else None


@pytest.mark.skipif(os.environ.get(library.SANITIZE_ENV) == "1", reason="already the sanitized run")
def test_the_kernels_tests_pass_under_address_and_undefined_behaviour_sanitizers():
    if os.environ.get(library.KERNEL_ENV) == "torch" or not library.compiler():
        pytest.skip("no C kernels on this machine (no compiler, or KVLIB_CPU_KERNELS=torch)")
    runtime = asan_runtime()
    if runtime is None:
        pytest.skip(f"the C compiler {library.compiler()[0]} has no ASan runtime (libasan.so)")
    env = {**os.environ, library.SANITIZE_ENV: "1", "LD_PRELOAD": runtime,
           "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",  # Python itself leaks by design
           "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    start = time.monotonic()
    deselect = [arg for test in DESELECTED for arg in ("--deselect", test)]
    narrow = [NARROW] if library.runs_here(library.X86_PATHS["portable+fma"]) else []
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k",
                           NOT_UNDER_SANITIZERS, *deselect, *SANITIZED, *narrow], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=900, check=False)
    output = done.stdout + done.stderr
    took = time.monotonic() - start
    assert done.returncode == 0, f"the sanitized run failed (exit {done.returncode}, {took:.0f} s):\n{output[-6000:]}"
    assert not [r for r in REPORTS if r in output], output[-6000:]
    assert " passed" in output and " skipped" not in output.split("\n")[-2], output[-2000:]


def test_the_sanitized_build_is_a_cache_entry_of_its_own(monkeypatch):
    cc = library.compiler() or [shutil.which("true") or "true"]
    monkeypatch.delenv(library.SANITIZE_ENV, raising=False)
    plain = library.build_key(cc)
    monkeypatch.setenv(library.SANITIZE_ENV, "1")
    assert library.build_key(cc) != plain
    assert set(library.SANITIZER_FLAGS) <= set(library.flags())
