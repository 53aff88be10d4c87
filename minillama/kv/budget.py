"""Byte budgets of a KV cache in closed form: what a spec holds at a given number of tokens.

The cache counts the bytes it really holds (``KVCache.live_bytes``); these formulas are what
the tests hold those counters to, and what a reader can check by hand. ``eval/budget.py``
prints a measured budget.
"""

from __future__ import annotations

from minillama.kv.codecs import CODE_PARTS, Codec
from minillama.kv.spec import KVSpec


def store_live_bytes(
    codec: Codec, group: int, spec: KVSpec, tokens: int, head_dim: int, centered: bool = False
) -> dict[str, float]:
    """Closed-form bytes per KV head for one tensor holding `tokens` tokens (no eviction)."""
    exact = codec.exact_dtype.itemsize
    sinks = min(spec.sinks, tokens)
    rest = tokens - sinks
    unit = codec.unit(group)
    tier_len, tier_codec = spec.tier_of(codec)
    # the body takes whole units of what is older than the residual and the tier
    body = max(0, (rest - spec.residual - tier_len) // unit * unit) if tokens >= spec.start else 0
    tier = max(0, rest - spec.residual - body) if tier_len else 0
    out = {
        "codes": 0.0,
        "scales": 0.0,
        "residual": (rest - body - tier) * head_dim * exact,
        "sinks": sinks * head_dim * exact,
    }
    coded = [(p, body) for p in codec.parts(head_dim, group)]
    coded += [(p, tier) for p in tier_codec.parts(head_dim, head_dim)] if tier_len else []
    for p, n in coded:
        key = "codes" if p.name in CODE_PARTS else "scales"
        out[key] += n // p.tokens_per_row * p.width * p.dtype.itemsize
    if centered and tokens:
        out["scales"] += head_dim * exact  # the per-channel key mean, one row per head
    return out


def formula_live_bytes(
    n_layers: int, n_kv_heads: int, head_dim: int, spec: KVSpec, tokens: int, batch: int = 1
) -> dict[str, int]:
    """Closed-form live bytes of a whole cache (every layer, KV head and sequence), by component."""
    heads = n_kv_heads * batch
    total = {"codes": 0, "scales": 0, "residual": 0, "sinks": 0}
    for layer in range(n_layers):
        for codec, group, centered in spec.tensors(layer):
            for key, value in store_live_bytes(codec, group, spec, tokens, head_dim, centered).items():
                total[key] += int(value) * heads
    return total
