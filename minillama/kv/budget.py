"""Byte budgets of a KV cache: measured by filling a real cache, and the closed form.

The measurement is the truth (the cache counts the bytes it holds); the closed form is
what the tests hold it to, and what a reader can check by hand.
"""

from __future__ import annotations

import torch

from minillama.kv.cache import KVCache
from minillama.kv.codecs import CODECS, Codec
from minillama.kv.spec import GRAMMAR, PRESET_NOTES, PRESETS, KVSpec, parse_kv


def store_live_bytes(codec: Codec, group: int, spec: KVSpec, tokens: int, head_dim: int,
                     centered: bool = False) -> dict[str, float]:
    """Closed-form bytes per KV head for one tensor holding `tokens` tokens (no eviction)."""
    exact = codec.float_dtype.itemsize if not codec.quantized else 2
    sinks = min(spec.sinks, tokens)
    rest = tokens - sinks
    unit = codec.unit(group)
    body = max(0, (rest - spec.residual) // unit * unit) if tokens >= spec.start else 0
    out = {"codes": 0.0, "scales": 0.0, "residual": (rest - body) * head_dim * exact, "sinks": sinks * head_dim * exact}
    for p in codec.parts(head_dim, group):
        key = "codes" if p.name in ("codes", "values") else "scales"
        out[key] += body // p.tokens_per_row * p.width * p.dtype.itemsize
    if centered and tokens:
        out["scales"] += head_dim * exact  # the per-channel key mean, one row per head
    if body:
        out["scales"] += codec.param_bytes(head_dim)  # per-sequence ranges (and grid), fitted at the first flush
    return out


def formula_live_bytes(n_layers: int, n_kv_heads: int, head_dim: int, spec: KVSpec, tokens: int,
                       batch: int = 1) -> dict[str, int]:
    """Closed-form live bytes of a whole cache (every layer, KV head and sequence), by component."""
    heads = n_kv_heads * batch
    total = {"codes": 0, "scales": 0, "residual": 0, "sinks": 0}
    for layer in range(n_layers):
        for codec, group, centered in spec.tensors(layer):
            for key, value in store_live_bytes(codec, group, spec, tokens, head_dim, centered).items():
                total[key] += int(value) * heads
    return total


def fill_synthetic(cache: KVCache, tokens: int, chunk: int = 512, seed: int = 0) -> None:
    """Append `tokens` random K/V (unit-Gaussian, a few outlier channels in K, as in real
    Llama keys) straight into the cache, without running a model."""
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
        cache.append(kv)
        done += n


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


def describe_codecs() -> str:
    lines = ["Presets (--kv NAME):"]
    for name, text in PRESETS.items():
        note = PRESET_NOTES.get(name, "")
        lines.append(f"  {name:<9} {text:<56} {note}")
    lines += ["", f"Codecs (--kv {GRAMMAR}); bits/element (G = group, T = tokens held):"]
    for c in CODECS.values():
        lines.append(f"  {c.name:<7} {c.bits_formula():<58} {c.about}")
    lines += ["", "Defaults: group 32; residual 32 when anything is quantized, else 0; sinks 0; center 0; rope post;",
              "positions absolute; start 0.",
              "center=1 stores keys minus a per-sequence channel mean (softmax ignores the shift; codes get finer).",
              "rope=pre stores keys before RoPE and rotates them when read; positions=cache numbers held tokens by slot.",
              "start=N keeps every token exact until N are held.",
              "Residual and sink tokens are stored in fp16 (unquantized codecs: in their own dtype)."]
    return "\n".join(lines)


__all__ = ["byte_budget", "describe_codecs", "fill_synthetic", "formula_live_bytes", "parse_kv"]
