"""Per-layer decode attention on a filled cache: the fused kernels alone, no model.

    python bench/attention_micro.py 8192 fp16,kivi4,hadv2,k4v3hc
    MINILLAMA_EXACT_ATTENTION=1 python bench/attention_micro.py 8192 kivi4,hadv2   # the exact float kernels

One layer of the default model's shape (3 KV heads, 3 query heads each, head_dim 64),
synthetic fill (budget.fill_synthetic), median of 30 calls after 3 warm-ups: the whole
fused_decode_attention for one query, and its two body kernels (scores, values) alone.
The same cache buffer is reused, so it sits in the L3 cache: this isolates compute from
DRAM bandwidth (the model's decode step reads each layer once, from memory).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from minillama.kv.budget import fill_synthetic
from minillama.kv.cache import KVCache
from minillama.kv.spec import parse_kv
from minillama.kv.fused_attention import _part_call, fused_decode_attention, integer_path


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
    for kv in (sys.argv[2] if len(sys.argv) > 2 else "fp16,kivi4,hadv2").split(","):
        cache = KVCache(parse_kv(kv), n_layers=1, n_kv_heads=3, head_dim=64, capacity=n + 64)
        fill_synthetic(cache, n)
        q, k, v = torch.randn(1, 9, 1, 64), torch.randn(1, 3, 1, 64), torch.randn(1, 3, 1, 64)
        layer = median_ms(lambda: fused_decode_attention(q, k, v, cache, 0))
        ks, vs = cache.layers[0]
        qg, s = torch.randn(1, 3, 3, 64), torch.empty(1, 3, 3, ks.n_body)  # q per KV head; scores
        scores = median_ms(lambda: _part_call("scores", ks, "body", ks.n_body, qg, 0, ks.n_body, s, None, 0))
        p, o = torch.softmax(torch.randn(1, 3, 3, vs.n_body), -1), torch.zeros(1, 3, 3, 64)
        values = median_ms(lambda: _part_call("values", vs, "body", vs.n_body, p, 0, vs.n_body, o, None, 0))
        path = "/".join("int" if integer_path(kind, st) else "float" for kind, st in (("scores", ks), ("values", vs)))
        print(f"{kv:10s} n={n}: layer {layer * 1000:.0f} us, scores kernel {scores * 1000:.0f} us, "
              f"values kernel {values * 1000:.0f} us ({path})")


if __name__ == "__main__":
    main()
