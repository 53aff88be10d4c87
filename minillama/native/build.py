"""Compile the C++ kernels for this CPU on first use, and cache the library.

Why a plain shared library called through ctypes rather than ``torch.utils.cpp_extension``:
the kernels only take raw pointers, so they build with one ``g++`` call in seconds, without
ninja or the PyTorch headers (a torch extension takes a minute to compile on a 2-core machine).

Targets: ``native`` compiles with ``-march=native`` (every instruction the CPU has: AVX2,
AVX-512, VNNI, BF16 ...; each kernel picks its path at compile time from what the target
has), ``avx2`` for x86-64-v3 (AVX2, FMA, F16C, BMI2: the oldest CPUs the fast paths are
written for), ``portable`` for any x86-64 (the plain C loops). On ARM (aarch64) ``native``
builds the plain loops for the CPU (NEON by the compiler's vectorizer), x86 intrinsics stay
behind their guards; a compiler without OpenMP builds one thread. The cached library is keyed
by the sources, the compiler, the flags **and the CPU's instruction-set features**, so a
cache directory shared between machines never hands one of them a binary it cannot run.
``MINILLAMA_LINE_TABLES=1`` adds line tables (``-g``; the same code) for profilers (perf,
addr2line), a library of its own in the cache. When no compiler is found or a
build fails, ``build`` says why in one line and returns None; the backend
(native/backend.py) then runs the PyTorch reference.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("*.cpp"))
HEADERS = sorted(HERE.glob("*.h"))  # included by the sources: part of the build's identity
# Reassociation lets GCC vectorize the float reductions; unlike -ffast-math it does not link
# crtfastmath, which would flush denormals to zero for the whole Python process.
COMMON = [
    "-O3",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-fno-math-errno",
    "-shared",
    "-fPIC",
    "-std=c++17",
]
X86 = platform.machine().lower() in ("x86_64", "amd64")
TARGETS = {
    # full-width AVX-512 where the CPU has it (GCC defaults to 256-bit vectors)
    "native": ["-march=native"] + (["-mprefer-vector-width=512"] if X86 else []),
    "avx2": ["-march=x86-64-v3"],
    "portable": ["-march=x86-64"] if X86 else [],
}
# The instruction-set extensions that decide which code a -march=native build contains.
ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "bmi2",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_bf16",
    "avx512_vnni",
    "avx512vbmi",
    "avx512_vbmi2",
    "avx_vnni",
    "amx_bf16",
    "asimd",
    "sve",
)


def cache_dir() -> Path:
    return Path(os.environ.get("MINILLAMA_CACHE", Path.home() / ".cache" / "minillama")) / "kernels"


@functools.lru_cache(maxsize=1)
def cpu_features() -> tuple[str, ...]:
    """The CPU's instruction-set extensions that matter here (from /proc/cpuinfo; on other systems,
    the platform's processor string stands in)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return (platform.machine(), platform.processor())
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags = set(line.split(":", 1)[1].split())
            break
    return (platform.machine(), *sorted(flags & set(ISA_FLAGS)))


def target_available(target: str) -> bool:
    """Whether this CPU can run a build for `target`."""
    if target == "avx2":
        return X86 and {"avx2", "fma", "f16c", "bmi2"} <= set(cpu_features())
    return target in TARGETS


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


@functools.cache
def openmp_flags(cxx: str) -> tuple[str, ...]:
    """-fopenmp where the compiler builds an OpenMP program with it (GCC; clang with libomp), else
    one thread and the pragmas quiet (native/openmp.h): Apple's clang has no OpenMP by default."""
    probe = "#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n"
    try:
        done = subprocess.run(
            [cxx, "-fopenmp", "-x", "c++", "-", "-o", os.devnull], input=probe, capture_output=True, text=True
        )
    except OSError:
        return ("-Wno-unknown-pragmas",)
    return ("-fopenmp",) if done.returncode == 0 else ("-Wno-unknown-pragmas",)


def compile_flags(target: str, cxx: str | None = None) -> list[str]:
    threads = list(openmp_flags(cxx or compiler() or "g++"))
    return COMMON + threads + TARGETS[target] + (["-g"] if os.environ.get("MINILLAMA_LINE_TABLES") == "1" else [])


def library_path(target: str, cxx: str) -> Path:
    """Where the build for `target` is cached: keyed by the sources, the compiler, the flags and
    the CPU's instruction-set features."""
    source = b"".join(path.read_bytes() for path in [*SOURCES, *HEADERS])
    identity = source + " ".join([cxx, *compile_flags(target, cxx), *cpu_features()]).encode()
    return cache_dir() / f"minillama-kernels-{target}-{hashlib.sha256(identity).hexdigest()[:16]}.so"


def needs_compiling(target: str = "native") -> bool:
    """Whether ``build(target)`` would compile now (nothing cached for this CPU and these sources)."""
    cxx = compiler()
    return bool(cxx) and target_available(target) and not library_path(target, cxx).exists()


@functools.cache
def build(target: str = "native") -> tuple[ctypes.CDLL | None, str]:
    """The kernels compiled for `target` (reused from the cache when built before): (library, "")
    or (None, why not)."""
    if not target_available(target):
        return None, f"this CPU cannot run a {target} build"
    cxx = compiler()
    if not cxx:
        return None, "no C++ compiler found (install g++)"
    lib_path = library_path(target, cxx)
    if not lib_path.exists():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib_path.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run(
            [cxx, *compile_flags(target, cxx), *map(str, SOURCES), "-o", str(tmp)], capture_output=True, text=True
        )
        if done.returncode:
            tmp.unlink(missing_ok=True)
            lines = done.stderr.strip().splitlines() or ["unknown error"]
            first = next((line for line in lines if "error" in line), lines[0])
            return None, f"the kernel build failed ({first[:120]})"
        os.replace(tmp, lib_path)
    try:
        return ctypes.CDLL(str(lib_path)), ""
    except OSError as e:
        return None, f"the kernel library would not load ({e})"
