"""Synthetic keys and values written straight into a cache, without running a model.

Unit Gaussians, with a few large-magnitude key channels as real Llama keys have: enough to
fill a cache of any size for byte budgets (``minillama kv``), decode benchmarks at long
context (``bench --fill synthetic``) and kernel tests, with no text and no forward pass.
"""

from __future__ import annotations

import torch

from minillama.kv.cache import KVCache
from minillama.kv.write import REFERENCE, Writer


def fill_synthetic(cache: KVCache, tokens: int, chunk: int = 512, seed: int = 0, writer: Writer = REFERENCE) -> None:
    """Append `tokens` random K/V (unit-Gaussian, a few outlier channels in K) to the cache, `chunk` at a time."""
    g = torch.Generator().manual_seed(seed)
    shape = (cache.batch, cache.n_kv_heads)
    outliers = torch.zeros(cache.head_dim)
    outliers[:: max(1, cache.head_dim // 4)] = 8.0  # a few large-magnitude key channels
    done = 0
    while done < tokens:
        n = min(chunk, tokens - done)
        kv = []
        for _ in range(cache.n_layers):
            k = torch.randn(*shape, n, cache.head_dim, generator=g) + outliers  # (B, H, n, D)
            v = torch.randn(*shape, n, cache.head_dim, generator=g)  # (B, H, n, D)
            kv.append((k, v))
        cache.append(kv, writer)
        done += n
