"""The CPU decode kernels (attention over packed codes, bf16 matrix-vector): compiled on
first use, called through ctypes.

Why ctypes and a plain shared library rather than ``torch.utils.cpp_extension``: the
kernel only needs raw pointers, so it builds with one ``g++`` call in about a second,
without ninja or the PyTorch headers (a torch extension takes a minute to compile on a
2-core machine). The library is cached under ``~/.cache/minillama`` keyed by a hash
of the source and compiler flags. When no compiler is found or the build fails, a
one-line notice goes to stderr and the pure-PyTorch reference path is used.
Set MINILLAMA_KERNEL=0 to force the reference path, MINILLAMA_EXACT_ATTENTION=1 to keep
the fused kernels but use the exact float ones instead of the integer-domain ones.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = [HERE / name for name in ("decode_attention.cpp", "row_attention.cpp", "int_attention.cpp",
                                     "layer_attention.cpp", "decode_ops.cpp", "encode.cpp", "linear.cpp")]
HEADERS = [HERE / "rows.h", HERE / "dtypes.h"]  # included by the sources: part of the build's identity
# Reassociation lets GCC vectorize the float reductions; unlike -ffast-math it does not link
# crtfastmath, which would flush denormals to zero for the whole Python process.
FLAGS = ["-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-fno-math-errno",
         "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
if platform.machine().lower() in ("x86_64", "amd64"):
    FLAGS.append("-mprefer-vector-width=512")  # full-width AVX-512 where the CPU has it (GCC defaults to 256)
# The same sources for a baseline x86-64 CPU (no AVX-512): the portable lookup-table paths.
PORTABLE_FLAGS = [f for f in FLAGS if not f.startswith(("-march", "-mprefer"))] + ["-march=x86-64"]

_P, _I = ctypes.c_void_p, ctypes.c_int
SIGNATURES = {  # every attention kernel ends with (n, ld, output)
    "scores_float": [_P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I, _P],
    "values_float": [_P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I, _P],
    "scores_token": [_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, _P],
    "values_token": [_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, _P],
    "scores_channel": [_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, _P],
    "values_channel": [_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, _P],
    "scores_rows": [_P, _P, _I, _I, _I, _I, _I, _I, _P],
    "values_rows": [_P, _P, _I, _I, _I, _I, _I, _I, _P],
    "scores_int": [_P, _P, _I, _I, _I, _I, _I, _I, _P],
    "values_int": [_P, _P, _I, _I, _I, _I, _I, _I, _P],
    "attend_part": [_I, _I, _P, _P, _I, _I, _I, _I, _I, _I, _P],
    "attend_layer": [_P],
    "add_rms_norm": [_P, _P, _P, _I, _I, _I, ctypes.c_float, _P, _P],
    "rope_rows": [_P, _I, _I, _I, _I, ctypes.c_int64, _P, _P],
    "silu_mul": [_P, _I, _I, _I, _P],
    "gemm_rows": [_P, _P, _I, _I, _I, _I, _P],
    "encode_affine": [_P, ctypes.c_int64, _I, _I, _I, _I, _I, _P, _P, _P],
}


def _cache_dir() -> Path:
    return Path(os.environ.get("MINILLAMA_CACHE", Path.home() / ".cache" / "minillama")) / "kernels"


def build(flags: list[str]) -> ctypes.CDLL | None:
    """Compile (or reuse from the cache) the kernels with these flags; None when that fails."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        print("minillama: no C++ compiler found; using the PyTorch reference paths (slower)", file=sys.stderr)
        return None
    source = b"".join(path.read_bytes() for path in [*SOURCES, *HEADERS])
    key = hashlib.sha256(source + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    lib_path = _cache_dir() / f"minillama-kernels-{key}.so"
    if not lib_path.exists():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib_path.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", str(tmp)], capture_output=True, text=True)
        if done.returncode:
            first = (done.stderr.strip().splitlines() or ["unknown error"])[0]
            print(f"minillama: kernel build failed ({first[:120]}); using the PyTorch reference paths", file=sys.stderr)
            return None
        os.replace(tmp, lib_path)
    lib = ctypes.CDLL(str(lib_path))
    for name, args in SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = None
    lib.int_attention_available.restype = ctypes.c_int
    lib.prepare_rows.argtypes = [_P, _I, ctypes.c_int64, _I, _I, _P, ctypes.c_int64, _P]
    lib.prepare_rows.restype = ctypes.c_int64
    return lib


@functools.lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The compiled kernel library for this CPU, or None (with a one-line notice) when it cannot be built."""
    if os.environ.get("MINILLAMA_KERNEL", "1") == "0":
        return None
    return build(FLAGS)
