"""Fused decode attention: one query token against the packed cache, no dequantized copy.

The same math as ``attention.attend`` (the reference and test oracle) for T = 1, but
the quantized body of the cache is read in place by the C++ kernel in
``kernels/decode_attention.cpp``: scales are folded into the query (keys) or into the
attention weights (values), codes are unpacked in registers. The small exact parts
(sinks, residual, the new token itself) use ordinary PyTorch ops.
"""

from __future__ import annotations

import ctypes
import math

import torch

from minillama.cache import KVCache, TensorStore
from minillama.kernels import load
from minillama.quantize import gaussian_codebook

FLOAT_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def available(cache: KVCache) -> bool:
    return cache.fused and load() is not None


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else None)


def _bits(store: TensorStore) -> int:
    return 5 if store.codec.kind == "ternary" else store.codec.bits


def _body_call(kind: str, store: TensorStore, x: torch.Tensor, out: torch.Tensor) -> None:
    """Run the kernel for the body of `store`: kind "scores" (x = q) or "values" (x = p)."""
    lib = load()
    b, h, r = x.shape[:3]
    d, n, codec = store.head_dim, store.n_body, store.codec
    if codec.kind == "float":
        ring = store.body["values"]
        getattr(lib, f"{kind}_float")(_ptr(x), _ptr(ring.buf), FLOAT_CODE[ring.buf.dtype], b, h, r, d,
                                      ring.slots, ring.start, n, _ptr(out))
        return
    codes, scale = store.body["codes"], store.body["scale"]
    zero = store.body["zero"].buf if "zero" in store.body else None
    if codec.kind == "channel":
        getattr(lib, f"{kind}_channel")(_ptr(x), _ptr(codes.buf), _ptr(scale.buf), _ptr(zero), b, h, r, d, _bits(store),
                                        store.group, codes.slots, codes.start, scale.slots, scale.start, n, _ptr(out))
    else:
        levels = gaussian_codebook(codec.bits) if codec.kind == "codebook" else None  # (2**bits,) float32
        getattr(lib, f"{kind}_token")(_ptr(x), _ptr(codes.buf), _ptr(scale.buf), _ptr(zero), _ptr(levels), b, h, r, d,
                                      _bits(store), store.group, codes.slots, codes.start, n, _ptr(out))


def _pieces(store: TensorStore) -> list[tuple[str, int]]:
    """The store's held tokens in age order, as (part, count): sinks, body, residual."""
    parts = [("sinks", store.sinks.count), ("body", store.n_body), ("residual", store.residual.count)]
    return [(name, n) for name, n in parts if n]


def fused_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int) -> torch.Tensor:
    """q (B, Hq, 1, D), new k, v (B, Hkv, 1, D) -> (B, Hq, 1, D); same result as attend() over cache.read()."""
    k_store, v_store = cache.layers[layer]
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    r = hq // hkv
    qg = k_store.codec.to_space(q.float()).reshape(b, hkv, r, d).contiguous()  # (B, Hkv, R, D), heads sharing a KV head
    scores = []
    for name, n in _pieces(k_store):
        if name == "body":
            s = torch.empty(b, hkv, r, n)  # (B, Hkv, R, n)
            _body_call("scores", k_store, qg, s)
        else:
            s = qg @ getattr(k_store, name).read().float().transpose(-1, -2)  # (B, Hkv, R, n)
        scores.append(s)
    k_own = k_store.codec.to_space(k.float())  # (B, Hkv, 1, D)
    if k_store.center is not None:
        k_own = k_own - k_store.center.float()  # stored keys are centered: shift the new one alike
    scores.append(qg @ k_own.transpose(-1, -2))  # (B, Hkv, R, 1)
    p = torch.softmax(torch.cat(scores, dim=-1) / math.sqrt(d), dim=-1)  # (B, Hkv, R, held+1)
    out = p[..., -1:] * v_store.codec.to_space(v.float())  # (B, Hkv, R, D): the new token's own value
    start = 0
    for name, n in _pieces(v_store):
        pn = p[..., start : start + n].contiguous()  # (B, Hkv, R, n)
        if name == "body":
            o = torch.empty(b, hkv, r, d)
            _body_call("values", v_store, pn, o)
        else:
            o = pn @ getattr(v_store, name).read().float()
        out += o
        start += n
    out = v_store.codec.to_space(out)  # back from rotated space, once per query
    cache.count_read(k_store.live_read_bytes() + v_store.live_read_bytes())
    return out.reshape(b, hq, 1, d).to(q.dtype)
