"""A native change measured on whole decode steps against a git revision's build, in turn, in one process.

    python tools/step_ab.py HEAD linear.cpp 512 30              # the tree's projections vs HEAD's
    python tools/step_ab.py HEAD~2 step.cpp,linear.cpp 8192 20 hadv2
    python tools/step_ab.py HEAD linear.cpp 512 30 fp16 avx2     # both builds for the AVX2 target
    python tools/step_ab.py HEAD linear.cpp 512 30 fp16 native weights/tinyllama-q4_0.gguf

tools/kernel_ab.py does this for one layer's attention; this is for what it does not reach: the
projections, the norms, the LM head, the step's driver. The tree's native sources are built as
``native/build.py`` builds them and a second library from the same sources with the named files
taken from REV (``kernel_ab.library_at``); the model (the last argument: a folder, or a GGUF file
whose blocks stay as stored; default: the default model's bfloat16 folder) gets a cache of the
given spec (default fp16) filled synthetically to the given context, and each round times
STEPS decode steps through one build, then through the other (the order alternates round by
round), through the native step's own phase timers (native/step.cpp: projections, attention,
the rest, the final norm and LM head). It prints each build's median ms per step and the median
of the per-round ratios tree/REV, for the step and for each phase (below 1: the tree is faster).
On a shared 2-core VM single rounds differ by 20%; the median of 30 rounds holds to a few percent.
A sixth argument names the build target (native/build.py: native, avx2, portable) for both.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from kernel_ab import library_at  # tools/ is the script's folder, so on sys.path

from minillama.app.default_model import resolve_model
from minillama.eval.synthetic import fill_synthetic
from minillama.kv.cache import KVCache
from minillama.kv.spec import parse_kv
from minillama.model.generate import decode_step
from minillama.native import backend, build, step
from minillama.native.fast import load_model
from minillama.native.write import writer

STEPS = 16  # decode steps per build and round
PHASES = ("projections", "attention", "rest", "head", "write")


def timed(lm, native, cache) -> tuple[float, list[float]]:
    """ms per step over STEPS steps of `native` (a NativeStep), and its phases in ms per step."""
    timing = torch.zeros(5, dtype=torch.float64)  # projections, attention, rest, head, write: seconds
    native.time_phases(timing)
    t0 = time.perf_counter()
    for _ in range(STEPS):
        decode_step(lm.model, min(1000, lm.config.vocab_size - 1), cache)
    elapsed = (time.perf_counter() - t0) / STEPS * 1000
    native.time_phases(None)
    return elapsed, [float(t) / STEPS * 1000 for t in timing]


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    rev, names = sys.argv[1], sys.argv[2].split(",")
    context = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 30
    spec = sys.argv[5] if len(sys.argv) > 5 else "fp16"
    target = sys.argv[6] if len(sys.argv) > 6 else "native"
    model = sys.argv[7] if len(sys.argv) > 7 else None
    build.TARGETS["native"] = build.TARGETS[target]  # what library_at compiles with
    backend.set_backend("kernels", target)
    tree = backend.library()
    if tree is None:
        sys.exit(f"the kernels are not in use: {backend.describe()}")
    other = library_at(rev, names, Path(tempfile.mkdtemp()))
    lm = load_model(resolve_model(model), "bfloat16")
    cache = KVCache.for_model(lm.config, parse_kv(spec), context + 2 * STEPS * (rounds + 1) + 64)
    fill_synthetic(cache, context, writer=writer())
    builds = {"tree": step.native_step(lm.model, tree, 1), rev: step.native_step(lm.model, other, 1)}
    libs = {"tree": tree, rev: other}
    ms: dict[str, list[float]] = {b: [] for b in builds}
    phases: dict[str, list[list[float]]] = {b: [] for b in builds}
    for r in range(rounds + 1):  # round 0 warms up
        for name in list(builds) if r % 2 else list(builds)[::-1]:
            backend.library = lambda device=None, lib=libs[name]: lib  # where the model asks for its kernels
            elapsed, p = timed(lm, builds[name], cache)
            if not p[0] > 0:  # the step this build describes did not run: the swap missed
                sys.exit(f"the {name} build's step did not run (no projection time): nothing to compare")
            if r:
                ms[name].append(elapsed)
                phases[name].append(p)
    print(
        f"{lm.name}, bf16 weights, {spec} cache at {context} tokens (synthetic fill), {rounds} rounds of {STEPS} steps"
    )
    print(f"{backend.describe()}; tree vs {rev} ({', '.join(names)}), {target} build")
    for name in builds:
        p = [statistics.median(row[i] for row in phases[name]) for i in range(4)]
        shown = "  ".join(f"{what} {t:.2f}" for what, t in zip(PHASES, p))
        print(f"{name:10s} {statistics.median(ms[name]):7.2f} ms/step  ({shown})")
    ratios = [a / b for a, b in zip(ms["tree"], ms[rev])]
    line = f"tree/{rev}: step {statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})"
    for i, what in enumerate(PHASES):
        line += f", {what} {statistics.median(a[i] / b[i] for a, b in zip(phases['tree'], phases[rev])):.3f}"
    print(line)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
