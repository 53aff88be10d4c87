"""Where one layer's decode attention spends its time: the kernel alone, no model.

    python bench/attention_micro.py 8192 fp16,kivi4,hadv2,k4v3hc,k4v3lmc,k3v2lm
    OMP_NUM_THREADS=1 python bench/attention_micro.py 8192 fp16,hadv2      # one thread: the balance
    MINILLAMA_BACKEND=kernels-exact python bench/attention_micro.py 8192 kivi4,hadv2   # no integer route

The default model's layer shape (3 KV heads, 3 query heads each, head_dim 64), synthetic fill
(eval/synthetic.py). For each spec:

* layer: ``attend_layer`` over a 30-layer cache, its plans built once and the layers taken in
  turn, so each reads its K/V from memory as a decode step does (median of 10 passes, per layer),
  with the bytes one layer holds and what that makes per second;
* scores / values: the body's block kernels alone (``attend_part``, one part, every head; the
  part's buffer is reused, so it sits in the L2/L3 caches: compute, not DRAM), in ns per held
  token and KV head -- the unit the layer's time is made of (3 KV heads x tokens per layer);
* rest: layer minus the two body kernels at the same token count (the online softmax, the
  merge, the sinks and residual parts, the queries' preparation, and the wait for memory).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from minillama.eval.synthetic import fill_synthetic
from minillama.kv.cache import KVCache
from minillama.kv.spec import parse_kv
from minillama.native import backend, ops
from minillama.native.plans import attend_one_part, decode_plan

LAYERS, H, R, D = 30, 3, 3, 64


def median_s(f, n: int = 10) -> float:
    for _ in range(2):
        f()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    lib = backend.library()
    if lib is None:
        sys.exit(f"the kernels are not in use: {backend.describe()}")
    print(f"{backend.describe()}; {os.environ.get('OMP_NUM_THREADS', 'all')} threads; {n} tokens")
    print(
        f"{'kv':10s} {'layer us':>9} {'layer MB':>9} {'GB/s':>6} {'scores ns':>10} {'values ns':>10} {'rest ns':>8}"
        "  (ns per token and KV head; routes)"
    )
    for kv in (sys.argv[2] if len(sys.argv) > 2 else "fp16,kivi4,hadv2").split(","):
        cache = KVCache(parse_kv(kv), n_layers=LAYERS, n_kv_heads=H, head_dim=D, capacity=n + 64)
        fill_synthetic(cache, n)
        q, k, v = torch.randn(1, H * R, 1, D), torch.randn(1, H, 1, D), torch.randn(1, H, 1, D)
        out, keep = torch.empty_like(q), []
        plans = [decode_plan(lib, q, k, v, out, cache.layer(i), None, keep) for i in range(LAYERS)]
        layer = median_s(lambda: [ops.attend_layer(lib, p) for p in plans]) / LAYERS
        layer_bytes = sum(cache.live_bytes().values()) / LAYERS
        k_parts, v_parts = cache.layer(0).parts()
        kb, vb = (next(p for p in parts if p.name == "body") for parts in (k_parts, v_parts))
        qg, s = torch.randn(1, H, R, D), torch.empty(1, H, R, kb.n)  # q per KV head; scores
        p, o = torch.softmax(torch.randn(1, H, R, vb.n), -1), torch.zeros(1, H, R, D)
        routes = [attend_one_part(lib, False, kb, qg, s).name, attend_one_part(lib, True, vb, p, o).name]
        scores = median_s(lambda: attend_one_part(lib, False, kb, qg, s)) / (kb.n * H)
        values = median_s(lambda: attend_one_part(lib, True, vb, p, o)) / (vb.n * H)
        rest = layer / (n * H) - scores - values
        print(
            f"{kv:10s} {layer * 1e6:9.0f} {layer_bytes / 1e6:9.2f} {layer_bytes / layer / 1e9:6.1f} "
            f"{scores * 1e9:10.1f} {values * 1e9:10.1f} {rest * 1e9:8.1f}  ({'/'.join(routes).lower()})"
        )


if __name__ == "__main__":
    main()
