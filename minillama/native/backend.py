"""The one backend switch: does a step run the PyTorch reference or the compiled kernels?

    reference       plain PyTorch everywhere: the readable specification, on any device
    kernels         the compiled kernels wherever they apply (the default): decode projections
                    and small ops, cache writes, decode attention straight over packed codes
                    (integer-domain dot products where a codec allows), causal attention
                    for prefill chunks (PyTorch's fused attention where no kernel applies)
                    and blocks of weights against activations rounded to int8 per block
    kernels-exact   the same, with decode attention and block products in exact float arithmetic

Set it from Python (``set_backend("reference")``, or ``with using("kernels-exact"): ...``),
from the command line (``minillama --backend reference ...``) or with MINILLAMA_BACKEND in
the environment (read once, at import). It is one process-wide setting, like
``torch.backends`` flags; the cache and the model are still passed explicitly.

Every fast path asks this module, and only this module, whether to run: ``library(device)``
returns the compiled library or None (take the reference). A kernel that refuses its input
(a shape it does not support) makes its caller take the reference too; ``fallback`` records
why, and ``describe()`` and ``fallbacks()`` show it (``bench`` rows, ``/stats``, ``--debug``).
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from minillama.errors import UserError
from minillama.native import abi
from minillama.native.build import build, needs_compiling

NAMES = ("reference", "kernels", "kernels-exact")


def _checked(name: str) -> str:
    if name not in NAMES:
        raise UserError(f"unknown backend {name!r}: choose {', '.join(NAMES)}")
    return name


_state = {"name": os.environ.get("MINILLAMA_BACKEND", "kernels"), "target": "native"}
_libraries: dict[str, tuple[ctypes.CDLL | None, str]] = {}
_fallbacks: dict[str, None] = {}  # reasons, in the order first seen
_tally: Counter[str] = Counter()  # how often each fast path ran, and each fallback was taken


def set_backend(name: str, target: str = "native") -> None:
    """Choose the backend for the whole process; `target` picks the kernel build (native/build.py)."""
    _state["name"], _state["target"] = _checked(name), target


@contextmanager
def using(name: str, target: str = "native") -> Iterator[None]:
    """Run a block with another backend, then restore the previous one."""
    saved = dict(_state)
    set_backend(name, target)
    try:
        yield
    finally:
        _state.update(saved)


def set_threads(n: int) -> None:
    """Run the kernels and PyTorch's CPU ops on `n` threads (by default they take every core this
    process may use), for the whole process; applied to a library when it loads, too."""
    _state["threads"] = n
    torch.set_num_threads(n)
    for lib, _ in _libraries.values():
        if lib is not None:
            lib.minillama_set_threads(n)


_DEFAULT_THREADS = torch.get_num_threads()  # PyTorch's own count, read before anything changes it


def threads() -> int:
    """The threads the kernels run on when nothing adapts them: --threads, else every core this
    process may use. (Not torch.get_num_threads(): the kernels and PyTorch share one OpenMP
    runtime, so a count the decode step's chooser sets shows there too.)"""
    return _state.get("threads") or _DEFAULT_THREADS


def adapt_threads(on: bool = True) -> None:
    """Let decode steps run on one core fewer while another process holds one (native/threads.py:
    ThreadChooser), unless ``set_threads`` fixed the count. Off by default: the count changes the
    order in which the threads' partial sums merge, so evaluations that must repeat to the last
    bit leave it off; generate and chat turn it on."""
    _state["adapt"] = on


def adaptive() -> bool:
    return bool(_state.get("adapt")) and not _state.get("threads")


def name() -> str:
    """The backend asked for (``reference``, ``kernels`` or ``kernels-exact``)."""
    return _checked(_state["name"])


def _load(target: str) -> tuple[ctypes.CDLL | None, str]:
    if target not in _libraries:
        # The first run on a machine compiles for about a minute: say so on a terminal, rather
        # than leave it blank before the first output.
        announce = sys.stderr.isatty() and needs_compiling(target)
        if announce:
            print("compiling the kernels for this CPU (once; about a minute) ...", end="", file=sys.stderr, flush=True)
        started = time.perf_counter()
        lib, why = build(target)
        if announce:
            print(f" done in {time.perf_counter() - started:.0f} s" if lib else " failed", file=sys.stderr)
        if lib is not None:
            why = abi.bind(lib)
            lib = None if why else lib
        if lib is not None and _state.get("threads"):
            lib.minillama_set_threads(_state["threads"])
        _libraries[target] = (lib, why)
    return _libraries[target]


def library(device: torch.device | str | None = None) -> ctypes.CDLL | None:
    """The compiled kernels when the backend uses them (and they built) for a tensor on `device`;
    None: run the PyTorch reference."""
    if name() == "reference" or (device is not None and torch.device(device).type != "cpu"):
        return None
    lib, why = _load(_state["target"])
    if lib is None:
        fallback(f"kernels unavailable ({why}): the PyTorch reference runs")
    return lib


def exact_arithmetic() -> bool:
    """Decode attention and block-weight products in exact float arithmetic (kernels-exact) instead
    of the integer domain."""
    return name() == "kernels-exact"


def fallback(reason: str) -> None:
    """Record why a fast path took the reference (shown by describe() and fallbacks()), each time."""
    _fallbacks.setdefault(reason)
    _tally["fallback: " + reason] += 1


def ran(path: str) -> None:
    """Count one run of a fast path ("decode step", "cache write", ...): proof that it ran."""
    _tally[path] += 1


def tally() -> Counter[str]:
    """A copy of the counts of ``ran`` and ``fallback``: compare two to see what a block of code
    ran (tests do, per test, whatever ran before them)."""
    return Counter(_tally)


def fallbacks() -> list[str]:
    return list(_fallbacks)


def describe() -> str:
    """One line: the backend and, for the kernels, the instruction sets they were built with."""
    if name() == "reference":
        return "reference (PyTorch)"
    lib, why = _load(_state["target"])
    if lib is None:
        return f"reference (kernels unavailable: {why})"
    arithmetic = "exact" if exact_arithmetic() else "integer"
    return f"{name()} ({_state['target']} build: {' '.join(abi.features(lib)) or 'portable'}; {arithmetic} attention and block products)"
