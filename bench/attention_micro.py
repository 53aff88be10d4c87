"""Per-layer decode attention on a filled cache: the fused kernels alone, no model.

    python bench/attention_micro.py 8192 fp16,kivi4,hadv2,k4v3hc
    MINILLAMA_BACKEND=kernels-exact python bench/attention_micro.py 8192 kivi4,hadv2   # the exact float kernels

One layer of the default model's shape (3 KV heads, 3 query heads each, head_dim 64),
synthetic fill (eval/synthetic.py), median of 30 calls after 3 warm-ups: the whole
fused_decode_attention for one query, and its two body kernels (scores, values) alone.
The same cache buffer is reused, so it sits in the L3 cache: this isolates compute from
DRAM bandwidth (the model's decode step reads each layer once, from memory).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from minillama.eval.synthetic import fill_synthetic
from minillama.kv.cache import KVCache
from minillama.kv.fused_attention import attend_one_part, fused_decode_attention
from minillama.kv.spec import parse_kv
from minillama.native import backend


def median_ms(f, n: int = 30) -> float:
    for _ in range(3):
        f()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    lib = backend.library()
    if lib is None:
        sys.exit(f"the kernels are not in use: {backend.describe()}")
    print(backend.describe())
    for kv in (sys.argv[2] if len(sys.argv) > 2 else "fp16,kivi4,hadv2").split(","):
        cache = KVCache(parse_kv(kv), n_layers=1, n_kv_heads=3, head_dim=64, capacity=n + 64)
        fill_synthetic(cache, n)
        q, k, v = torch.randn(1, 9, 1, 64), torch.randn(1, 3, 1, 64), torch.randn(1, 3, 1, 64)
        layer = median_ms(lambda: fused_decode_attention(lib, q, k, v, cache.layer(0)))
        k_parts, v_parts = cache.layer(0).parts()
        kb, vb = (next(p for p in parts if p.name == "body") for parts in (k_parts, v_parts))
        qg, s = torch.randn(1, 3, 3, 64), torch.empty(1, 3, 3, kb.n)  # q per KV head; scores
        p, o = torch.softmax(torch.randn(1, 3, 3, vb.n), -1), torch.zeros(1, 3, 3, 64)
        routes = [attend_one_part(lib, False, kb, qg, s).name, attend_one_part(lib, True, vb, p, o).name]
        scores = median_ms(lambda: attend_one_part(lib, False, kb, qg, s))
        values = median_ms(lambda: attend_one_part(lib, True, vb, p, o))
        print(f"{kv:10s} n={n}: layer {layer * 1000:.0f} us, scores kernel {scores * 1000:.0f} us, "
              f"values kernel {values * 1000:.0f} us ({'/'.join(routes).lower()})")


if __name__ == "__main__":
    main()
