"""The byte budget of a cache spec, measured: fill a real cache and read its counters.

``minillama kv SPEC --tokens N`` prints this. The measurement is the truth (the cache
counts the bytes it holds); ``kv/budget.py`` has the closed form the tests hold it to.
"""

from __future__ import annotations

from minillama.eval.synthetic import fill_synthetic
from minillama.kv.cache import KVCache
from minillama.kv.spec import KVSpec


def byte_budget(n_layers: int, n_kv_heads: int, head_dim: int, spec: KVSpec, tokens: int) -> str:
    """A printable budget of `spec` for a model of these sizes at `tokens` tokens, measured from a real cache."""
    cache = KVCache(spec, n_layers, n_kv_heads, head_dim, capacity=max(tokens, spec.sinks + spec.residual + spec.unit))
    fill_synthetic(cache, tokens)
    live = cache.live_bytes()
    fp16 = n_layers * 2 * n_kv_heads * head_dim * tokens * 2
    per_tok = sum(live.values()) / tokens / n_layers / n_kv_heads
    lines = [
        f"kv {spec}: k={spec.k.name} v={spec.v.name} kgroup={spec.kgroup} vgroup={spec.vgroup} residual={spec.residual} "
        f"sinks={spec.sinks}" + (" center=1" if spec.center else "") + (" rope=pre" if spec.rope == "pre" else "")
        + (" positions=cache" if spec.positions == "cache" else "") + (f" start={spec.start}" if spec.start else ""),
        f"model: {n_layers} layers x {n_kv_heads} KV heads x head_dim {head_dim}; {tokens} tokens",
        *(f"  {k:<9}{v:>14,d} bytes" for k, v in live.items()),
        f"  {'live':<9}{sum(live.values()):>14,d} bytes ({sum(live.values()) / 2**20:.2f} MiB, {sum(live.values()) / fp16:.1%} of fp16)",
        f"  {'allocated':<9}{cache.allocated_bytes():>14,d} bytes (capacity {cache.capacity} tokens)",
        f"  bits/element {cache.bits_per_element():.3f}; {per_tok:.1f} bytes per token per KV head (K+V)",
    ]
    return "\n".join(lines)
