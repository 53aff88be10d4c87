"""One layer's decode attention per KV spec, the specs timed in turn, round after round.

    python tools/attention_rounds.py 8192 "fp16;kivi4;hadv2;k4v3hc;k4v3lmc;k3v2lm"
    python tools/attention_rounds.py 8192 "fp16;k=int4c,v=fp16,group=32,residual=32"   # one side alone
    python tools/attention_rounds.py 8192 "fp16;hadv2;k4v3lmc" 10 tinyllama   # TinyLlama-1.1B's layer shape (GQA 8)

On a shared 2-core VM a single timing moves by 30% from one minute to the next, so a ratio of
two separate runs says little. Here every spec's 30-layer cache is built first (synthetic fill,
the default model's shape: 3 KV heads, 3 query heads each, head_dim 64), then each round times
one pass of ``attend_layer`` over all 30 layers (each reads its K/V from memory, as a decode
step does) for every spec in turn; the median per spec and its ratio to the first spec are
printed, with the quartiles. Specs are separated by ';' (a spec itself holds commas), or by '|'
when a spec holds ';' itself (``layers=K/V;K/V;...``, as ``kv allocate`` prints it). A fourth
argument names another layer shape: ``tinyllama`` (22 layers, 4 KV heads, 8 query heads each,
head_dim 64: bench/tinyllama_shape.py), where the integer kernels do R = 8 heads' work per row,
or ``llama3`` (Llama-3-8B's layer: 8 KV heads, 4 query heads each, head_dim 128; 8 layers, each
of whose fp16 K+V at 8192 tokens, 34 MB, is past the L3 already), the head_dim 128 kernels.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from minillama.eval.synthetic import fill_synthetic
from minillama.kv.cache import KVCache
from minillama.kv.spec import parse_kv
from minillama.native import backend, ops
from minillama.native.plans import decode_plan
from minillama.native.write import writer

SHAPES = {  # (layers, KV heads, query heads per KV head, head_dim)
    "smollm2": (30, 3, 3, 64),  # the default model
    "tinyllama": (22, 4, 8, 64),
    "llama3": (8, 8, 4, 128),
}


class Layers:
    """A shape's 30-layer (22, 8) caches filled with synthetic K/V, one per spec, and one
    decode token's q, k, v: what both this script and tools/kernel_ab.py time."""

    def __init__(self, shape: str, n: int):
        if shape not in SHAPES:
            sys.exit(f"unknown shape {shape!r}: use one of {', '.join(SHAPES)}")
        self.layers, h, r, d = SHAPES[shape]
        self.n, self.h, self.d = n, h, d
        self.q, self.k, self.v = torch.randn(1, h * r, 1, d), torch.randn(1, h, 1, d), torch.randn(1, h, 1, d)
        self.out, self.keep = torch.empty_like(self.q), []  # (B, Hq, 1, D); what the plans point into

    def cache(self, kv: str) -> KVCache:
        cache = KVCache(parse_kv(kv), n_layers=self.layers, n_kv_heads=self.h, head_dim=self.d, capacity=self.n + 64)
        fill_synthetic(cache, self.n, writer=writer())
        self.keep.append(cache)
        return cache

    def plans(self, lib, cache: KVCache) -> list:
        """Every layer of `cache` described to `lib`'s attention kernel."""
        return [
            decode_plan(lib, self.q, self.k, self.v, self.out, cache.layer(i), None, self.keep)
            for i in range(self.layers)
        ]

    @staticmethod
    def seconds(lib, plans: list) -> float:
        """One pass of ``attend_layer`` over every layer (each reads its K/V from memory): seconds per layer."""
        t0 = time.perf_counter()
        for plan in plans:
            ops.attend_layer(lib, plan)
        return (time.perf_counter() - t0) / len(plans)


def spec_list(listed: str) -> list[str]:
    """Specs separated by ';', or by '|' when one holds the ';' of ``layers=`` itself."""
    return listed.split("|" if "|" in listed else ";")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    specs = spec_list(sys.argv[2] if len(sys.argv) > 2 else "fp16;kivi4;hadv2")
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    shape = sys.argv[4] if len(sys.argv) > 4 else "smollm2"
    lib = backend.library()
    if lib is None:
        sys.exit(f"the kernels are not in use: {backend.describe()}")
    layers = Layers(shape, n)
    plans = {kv: layers.plans(lib, layers.cache(kv)) for kv in specs}
    times: dict[str, list[float]] = {kv: [] for kv in specs}
    for _ in range(rounds):
        for kv in specs:
            times[kv].append(Layers.seconds(lib, plans[kv]))
    print(f"{backend.describe()}; {shape} layer shape; {n} tokens; median of {rounds} rounds, one layer")
    first = statistics.median(times[specs[0]])
    for kv in specs:
        median, (q1, _, q3) = statistics.median(times[kv]), statistics.quantiles(times[kv], n=4)
        print(f"{kv:40s} {median * 1e6:7.0f} us (quartiles {q1 * 1e6:.0f}-{q3 * 1e6:.0f})  {median / first:.2f}x")


if __name__ == "__main__":
    main()
