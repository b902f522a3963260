"""The build and loading of kvlib's CPU kernels (csrc/): compiled with the machine's C compiler (`cc`, OpenMP; ~1 s)
into one shared library in the kvlib cache, then loaded through ctypes with every entry point's signature declared.
The entry points' wrappers, and the checks of what they are given, are kvlib.kernels.cpu_kernel and
kvlib.kernels.checks.

The library is keyed by the sources, the flags, the compiler (its path and `--version`) and the CPU (the features
`-march=native` resolves to, and /proc/cpuinfo's model and feature lines on x86 and ARM alike), so a machine builds it
once and two machines sharing a cache never load each other's build. It links the same libgomp soname torch loads,
so its threads are torch's OpenMP pool (torch.set_num_threads holds for it): no second runtime.

The vector code is written for the vector width the CPU has (csrc/vectors.h picks AVX-512's 16 floats, AVX's 8, or a
portable 4 from the compiler's target macros) in the same order of operations on every path; `instruction_set()` says
which one the loaded build runs. `build(target)` builds another path (X86_PATHS) for tests and benchmarks.

KVLIB_CPU_KERNELS=torch: never use the C kernels. KVLIB_CPU_KERNELS_SANITIZE=1: load a build under AddressSanitizer
and UndefinedBehaviorSanitizer (its own cache entry), which needs the ASan runtime preloaded
(tests/kernels/test_kernel_sanitizers.py runs the kernels' tests so).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import warnings
from functools import cache
from pathlib import Path

from kvlib.paths import cache_dir

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.[ch]"))
NATIVE = ["-march=native"]  # the target: vectors.h's path follows what it enables
FLAGS = ["-O3", *NATIVE, "-fopenmp", "-fPIC", "-shared", "-Wall", "-Wextra"]
SANITIZER_FLAGS = ["-fsanitize=address,undefined,float-cast-overflow", "-fno-sanitize-recover=all",
                   "-fno-omit-frame-pointer", "-g"]
LIBS = ["-lm"]
KERNEL_ENV = "KVLIB_CPU_KERNELS"  # "torch": never use the C kernels
SANITIZE_ENV = "KVLIB_CPU_KERNELS_SANITIZE"  # "1": the sanitized build
# /proc/cpuinfo's lines that say what -march=native targets: x86 ("model name", "flags"), ARM ("Features", "CPU
# implementer/architecture/variant/part"), RISC-V ("isa", "uarch"), POWER ("cpu")
CPU_LINES = ("model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU variant", "CPU part",
             "isa", "uarch", "cpu\t")


# Each vector path of csrc/vectors.h on x86, as the targets that build it in place of -march=native (tests and
# benchmarks build the paths this CPU runs). "portable+fma" is the 4-float path fused as aarch64's NEON runs it;
# "avx" (Sandy Bridge's) and "portable" (x86-64's SSE2 baseline) have no fused multiply-add: each a x b + c is
# rounded twice.
X86_PATHS = {"avx512": ["-march=x86-64-v4"], "avx2": ["-march=x86-64-v3"],
             "portable+fma": ["-march=x86-64-v3", "-DKVLIB_VECTOR_WIDTH=4"], "avx": ["-march=x86-64-v2", "-mavx"],
             "portable": ["-march=x86-64"]}


def sanitized() -> bool:
    return os.environ.get(SANITIZE_ENV, "") == "1"


def compiler() -> list[str]:
    """The C compiler's command: $CC, else cc or gcc found on PATH, its path resolved ([] where there is none)."""
    given = shlex.split(os.environ.get("CC", ""))
    if given:
        return [shutil.which(given[0]) or given[0], *given[1:]]
    found = shutil.which("cc") or shutil.which("gcc")
    return [os.path.realpath(found)] if found else []


def _output(command: list[str]) -> str:
    """What a command prints (stdout and stderr), or '' where it cannot run."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout + done.stderr


def _cpu(cc: list[str]) -> str:
    """The CPU a -march=native build is for: the target flags the compiler resolves `native` to (gcc and clang print
    them in the commands `-###` shows), and /proc/cpuinfo's model and feature lines."""
    commands = _output([*cc, "-march=native", "-###", "-E", "-x", "c", os.devnull]) if cc else ""
    resolved = sorted({w.strip('"') for w in commands.split() if w.strip('"').startswith(("-m", "-target-feature",
                                                                                          "+", "--param"))})
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = platform.processor()
    return "\n".join([platform.machine(), *resolved, cpu_lines(cpuinfo)])


def cpu_lines(cpuinfo: str) -> str:
    """/proc/cpuinfo's lines that say which CPU it is and what it can run, each distinct one once."""
    return "\n".join(dict.fromkeys(line for line in cpuinfo.splitlines() if line.startswith(CPU_LINES)))


def flags(target: list[str] | None = None) -> list[str]:
    """The build's flags; target (e.g. X86_PATHS' entries) in place of -march=native."""
    chosen = FLAGS if target is None else [f for f in FLAGS if f not in NATIVE] + target
    return chosen + SANITIZER_FLAGS if sanitized() else chosen


def _isa_macros(cc: list[str], target: list[str]) -> set[str]:
    """The instruction-set macros (__AVX2__, __FMA__, ...) the compiler defines for a target."""
    text = _output([*cc, *target, "-dM", "-E", "-x", "c", os.devnull])
    return {w[1] for w in (line.split() for line in text.splitlines()) if len(w) == 3 and w[2] == "1"
            and w[1].startswith("__") and w[1].endswith("__") and w[1].strip("_").replace("_", "").isalnum()
            and w[1].upper() == w[1]}


def runs_here(target: list[str]) -> bool:
    """Whether this CPU runs a build for target: every instruction set it enables is one -march=native enables."""
    cc = compiler()
    if not cc:
        return False
    wanted, native = _isa_macros(cc, target), _isa_macros(cc, NATIVE)
    return bool(wanted) and bool(native) and wanted <= native


def build_key(cc: list[str], target: list[str] | None = None) -> str:
    """What names a build: the sources, flags, compiler (path and version) and CPU."""
    parts = [*(p.read_bytes() for p in SOURCES), " ".join(flags(target) + LIBS).encode(), " ".join(cc).encode(),
             _output([*cc, "--version"]).encode() if cc else b"", _cpu(cc).encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def build(target: list[str] | None = None) -> Path:
    """The built library's path (built now if it has not been), for this CPU or for target (see flags)."""
    cc = compiler()
    if not cc:
        raise RuntimeError("no C compiler (cc) found")
    name = "kvlib_cpu-asan" if sanitized() else "kvlib_cpu"
    path = cache_dir() / "kernels" / f"{name}-{build_key(cc, target)}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # built aside, then renamed: concurrent builds
            built = Path(tmp) / path.name                           # (Ray workers) never load a half-written file
            sources = [str(p) for p in SOURCES if p.suffix == ".c"]
            subprocess.run([*cc, *flags(target), "-o", str(built), *sources, *LIBS], check=True, capture_output=True,
                           text=True)
            os.replace(built, path)
    return path


class Quantized(ctypes.Structure):
    """csrc/decode_attention.c's `quantized`: where rows' oldest tokens are codes (kvlib.kernels.quantized)."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("key_codes", "value_codes", "key_scale", "key_zero",
                                                     "value_scale", "value_zero", "rows", "keys_quantized",
                                                     "values_quantized")] + \
               [(name, ctypes.c_int64) for name in ("n_rows", "bits", "code_bytes", "capacity", "group", "value_group")]


@cache
def library() -> ctypes.CDLL | None:
    """The loaded library (see load); None where it cannot be built, with a warning."""
    if platform.system() != "Linux":
        return None
    try:
        return load(build())
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        warnings.warn(f"kvlib's C kernels could not be built ({detail}); the engine uses PyTorch's ops instead",
                      RuntimeWarning, stacklevel=3)
        return None


def load(path: Path) -> ctypes.CDLL:
    """A built library, every entry point's signature declared, its limits read (chunk, max_group, max_dim, lanes:
    the logical vector width callers' widths are multiples of, 16 on every path) and its vector path (isa, width:
    the native vector's floats, fma: whether a x b + c is fused)."""
    lib = ctypes.CDLL(str(path))
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    signatures = {
        "decode_attention": [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ptr, i64, i64, i64, i64, i64, i64, i64, f32,
                             ptr, i64, ptr, ptr, i64, ctypes.POINTER(Quantized)],
        "add_rms_norm": [ptr, ptr, ptr, ptr, i64, i64, f32],
        "rope": [ptr, i64, ptr, ptr, i64, i64, i64],
        "silu_mul": [ptr, ptr, i64, i64],
        "quest_select": [ptr, ptr, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, ptr, i64, ptr],
        "infinigen_select": [ptr, ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64, i64, f32, f32, ptr, i64, ptr],
        "kivi_store": [ptr, ptr, i64, i64, ptr, ptr, i64, *[ptr] * 8, *[i64] * 8],
    }
    for name, argtypes in signatures.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = argtypes, ctypes.c_int
    limits = [i64() for _ in range(4)]
    lib.decode_attention_limits(*map(ctypes.byref, limits))
    lib.chunk, lib.max_group, lib.max_dim, lib.lanes = (x.value for x in limits)
    isa, width, fma = ctypes.c_char_p(), i64(), i64()
    lib.vector_path(*map(ctypes.byref, (isa, width, fma)))
    lib.isa, lib.width, lib.fma = isa.value.decode(), width.value, bool(fma.value)
    return lib


def instruction_set() -> str | None:
    """Which vector path the C kernels run here, e.g. "avx512 (16-float vectors, FMA)"; None without them."""
    lib = library() if os.environ.get(KERNEL_ENV, "") != "torch" else None
    return None if lib is None else describe(lib)


def describe(lib: ctypes.CDLL) -> str:
    return f"{lib.isa} ({lib.width}-float vectors, {'FMA' if lib.fma else 'no FMA'})"


def available() -> bool:
    """Whether the engine on a CPU runs kvlib's C kernels (built now if they have not been)."""
    return os.environ.get(KERNEL_ENV, "") != "torch" and library() is not None
