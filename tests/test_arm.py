"""The kernels beyond x86: they build for aarch64 (Apple Silicon, Graviton, Raspberry Pi) with
warnings as errors, run there as their scalar twins say (tests/native_check.cpp under
qemu-aarch64), and build without OpenMP (Apple's clang) as one thread.

The cross compiler and qemu come from Debian (`apt-get install g++-aarch64-linux-gnu qemu-user`,
which .ci/run does where it can); without them the aarch64 tests skip and say so.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
import torch

from minillama.native import abi, build, ops
from minillama.native.build import COMMON, HERE, SOURCES

CROSS = shutil.which("aarch64-linux-gnu-g++")
QEMU = shutil.which("qemu-aarch64")
CHECK = HERE.parent.parent / "tests" / "native_check.cpp"
ARM = ["-std=c++17", "-march=armv8.2-a+dotprod", "-Wall", "-Werror"]
needs_cross = pytest.mark.skipif(
    CROSS is None, reason="no aarch64-linux-gnu-g++ (apt-get install g++-aarch64-linux-gnu)"
)


@needs_cross
def test_the_kernels_build_for_aarch64_with_warnings_as_errors_and_match_their_twins(tmp_path):
    """Every source, -O3 with OpenMP as build.py compiles them, into one static program with the
    scalar checks; under qemu-aarch64 (when at hand) every check passes."""
    program = tmp_path / "check"
    done = subprocess.run(
        [CROSS, "-O3", "-fopenmp", "-static", *ARM, *map(str, SOURCES), str(CHECK), "-o", str(program)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    if objdump:  # the int8 block products compiled to sdot (ARMv8.2 dot products), not the plain loop
        assert "\tsdot\t" in subprocess.run([objdump, "-d", str(program)], capture_output=True, text=True).stdout
    if QEMU is None:
        pytest.skip("built; no qemu-aarch64 to run it (apt-get install qemu-user)")
    ran = subprocess.run([QEMU, str(program)], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0 and "all checks passed" in ran.stdout, ran.stdout + ran.stderr
    assert ran.stdout.count("\nok ") + ran.stdout.startswith("ok ") >= 28
    assert "(NEON 1, dot products 1)" in ran.stdout and ran.stdout.count("x int8") == 15  # 5 types x 3 shapes
    assert ran.stdout.count("gemm_rows bfloat16") == 3  # the NEON float kernel, rows of x 1, 2, 5


@needs_cross
def test_the_kernels_compile_for_aarch64_without_openmp():
    flags = [f for f in COMMON if f not in ("-O3", "-shared", "-fPIC")]
    done = subprocess.run(
        [CROSS, "-fsyntax-only", *flags, *ARM, "-Wno-unknown-pragmas", *map(str, SOURCES)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_build_without_openmp_is_one_thread_and_computes_the_same(tmp_path):
    """Where the compiler has no OpenMP (build.py: openmp_flags), native/openmp.h makes the
    kernels a team of one: the library says so, and its attention equals the reference."""
    cxx = build.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    library = tmp_path / "one-thread.so"
    flags = [f for f in COMMON if f != "-O3"]  # -O0: the check is what runs, not how fast
    done = subprocess.run(
        [cxx, "-O0", *flags, "-Wno-unknown-pragmas", *map(str, SOURCES), "-o", str(library)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lib = ctypes.CDLL(str(library))
    assert abi.bind(lib) == ""
    assert "no OpenMP: one thread" in abi.features(lib) and lib.minillama_threads() == 1
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, t, 80, generator=g) for h, t in ((4, 5), (2, 9), (2, 9)))  # (B, H, T, D)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=causal(5, 9)
    )
    assert torch.allclose(ops.causal_attention(lib, q, k, v), expected, atol=1e-5)


def causal(t: int, length: int) -> torch.Tensor:
    """(t, length) True where query i may see key j: its past and itself (keys 0 .. length - t + i)."""
    return torch.ones(t, length, dtype=torch.bool).tril(length - t)
