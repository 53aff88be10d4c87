"""Whole decode steps of several KV schemes in turn, in one process: the ratio a target is judged on.

    python bench/step_rounds.py 8192 "fp16;hadv2;kivi4;k4v3hc;k4v3lmc;k3v2lm" 10
    python bench/step_rounds.py 32768 "fp16;hadv2" 6
    python bench/step_rounds.py 8192 "fp16;hadv2;k4v3lmc" 6 weights/tinyllama-shape   # another model

``minillama bench`` times each scheme in its own stretch of minutes, and on a shared 2-core VM
the machine's speed drifts by more than most differences between schemes. Here every scheme's
cache is filled once (synthetic keys and values, eval/synthetic.py) at the given context, on the
default model (or the model folder given last) in bfloat16, and each round times 8 decode steps of every scheme in turn; it
prints each scheme's median ms per step, the median of its per-round ratios to the first
scheme, and the median of the native step's own phases (native/step.cpp: projections,
attention, the rest, final norm and LM head, the cache write); "outside" is the step less those
phases: Python (the write's description and counters among it) and ctypes. Specs are separated
by ';'.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from minillama.app.default_model import resolve_model
from minillama.eval.bench import weight_kinds
from minillama.eval.synthetic import fill_synthetic
from minillama.kv.cache import KVCache
from minillama.kv.spec import parse_kv
from minillama.model.generate import decode_step
from minillama.native import backend, step
from minillama.native.fast import load_model
from minillama.native.write import writer

STEPS = 8  # decode steps per scheme and round


def spec_list(listed: str) -> list[str]:
    """Specs separated by ';', or by '|' when one holds the ';' of ``layers=`` itself."""
    return listed.split("|" if "|" in listed else ";")


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    context, specs = int(sys.argv[1]), spec_list(sys.argv[2])
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    model = sys.argv[4] if len(sys.argv) > 4 else None
    lib = backend.library()
    if lib is None:
        sys.exit(f"the kernels are not in use: {backend.describe()}")
    lm = load_model(resolve_model(model), "bfloat16")
    caches = {}
    for spec in specs:
        caches[spec] = KVCache.for_model(lm.config, parse_kv(spec), context + STEPS * (rounds + 1) + 64)
        fill_synthetic(caches[spec], context, writer=writer())
    native = step.native_step(lm.model, lib, 1)
    token = min(1000, lm.config.vocab_size - 1)  # any token: the step reads the whole cache alike
    ms: dict[str, list[float]] = {s: [] for s in specs}
    phases: dict[str, list[list[float]]] = {s: [] for s in specs}
    for r in range(rounds + 1):  # round 0 warms up
        for spec in specs:
            timing = torch.zeros(5, dtype=torch.float64)  # projections, attention, rest, head, write: seconds
            native.time_phases(timing)
            t0 = time.perf_counter()
            for _ in range(STEPS):
                decode_step(lm.model, token, caches[spec])
            elapsed = (time.perf_counter() - t0) / STEPS * 1000
            native.time_phases(None)
            if r:
                ms[spec].append(elapsed)
                phases[spec].append([float(t) / STEPS * 1000 for t in timing])
    print(
        f"{lm.name}, {weight_kinds(lm.model)} weights, {context} tokens (synthetic fill), {rounds} rounds; {backend.describe()}"
    )
    cols = ("proj", "attn", "rest", "head", "write")
    print(f"{'kv':12s} {'ms/step':>8} {'ratio':>6}  " + " ".join(f"{c:>6}" for c in cols) + f" {'outside':>8}")
    for spec in specs:
        ratio = statistics.median(a / b for a, b in zip(ms[spec], ms[specs[0]]))
        p = [statistics.median(row[i] for row in phases[spec]) for i in range(len(cols))]
        step_ms = statistics.median(ms[spec])
        print(
            f"{spec[:12]:12s} {step_ms:8.2f} {ratio:6.3f}  "
            + " ".join(f"{x:6.2f}" for x in p)
            + f" {step_ms - sum(p):8.2f}"
        )


if __name__ == "__main__":
    with torch.inference_mode():
        main()
