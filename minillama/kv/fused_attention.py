"""Fused decode attention: one query token against the packed cache, no dequantized copy.

The same math as ``attention.attend`` (the reference and test oracle) for T = 1, but
every part of the cache is read in place by the C++ kernels in
``kernels/decode_attention.cpp``: the quantized body (per-channel key scales folded into
the query, per-token rows unpacked and scaled in registers), and the exact sinks and
residual (fp16 rings). Each part writes its columns of one score matrix, so nothing is
concatenated; only the new token's own key and value use PyTorch ops.
"""

from __future__ import annotations

import ctypes
import math

import torch

from minillama.kv.cache import KVCache
from minillama.kv.store import TensorStore
from minillama.kv.kernels import load
from minillama.kv.quantize import gaussian_codebook

FLOAT_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def available(cache: KVCache) -> bool:
    return cache.fused and load() is not None


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else None)


def _bits(store: TensorStore) -> int:
    return 5 if store.codec.kind == "ternary" else store.codec.bits


def _ptr_at(t: torch.Tensor, column: int) -> ctypes.c_void_p:
    """Pointer to column `column` of the first row of a float32 tensor (rows are ld apart)."""
    return ctypes.c_void_p(t.data_ptr() + 4 * column)


def _in(kind: str, x: torch.Tensor, column: int) -> ctypes.c_void_p:
    return _ptr(x) if kind == "scores" else _ptr_at(x, column)  # all of q; p from this part's columns


def _out(kind: str, out: torch.Tensor, column: int) -> ctypes.c_void_p:
    return _ptr_at(out, column) if kind == "scores" else _ptr(out)  # scores into this part's columns; values added


def _ring_call(kind: str, ring, x: torch.Tensor, column: int, ld: int, out: torch.Tensor) -> None:
    """Kernel over an unquantized ring (sinks, residual, or the body of a float codec)."""
    b, h, r = x.shape[:3]
    getattr(load(), f"{kind}_float")(_in(kind, x, column), _ptr(ring.buf), FLOAT_CODE[ring.buf.dtype], b, h, r,
                                     ring.buf.shape[-1], ring.slots, ring.start, ring.count, ld, _out(kind, out, column))


def _body_call(kind: str, store: TensorStore, x: torch.Tensor, column: int, ld: int, out: torch.Tensor) -> None:
    """Kernel over the body of `store`. kind "scores": x = q (B, H, R, D), the scores go to
    columns [column, column + n_body) of out (rows ld apart). kind "values": x = p, whose
    columns from `column` weight the body's values, added to out (B, H, R, D)."""
    codec = store.codec
    if codec.kind == "float":
        return _ring_call(kind, store.body["values"], x, column, ld, out)
    lib = load()
    b, h, r = x.shape[:3]
    d, n = store.head_dim, store.n_body
    codes, scale = store.body["codes"], store.body["scale"]
    zero = store.body["zero"].buf if "zero" in store.body else None
    if codec.kind == "channel":
        getattr(lib, f"{kind}_channel")(_in(kind, x, column), _ptr(codes.buf), _ptr(scale.buf), _ptr(zero), b, h, r, d,
                                        _bits(store), store.group, codes.slots, codes.start, scale.slots, scale.start,
                                        n, ld, _out(kind, out, column))
    else:
        levels = gaussian_codebook(codec.bits) if codec.kind == "codebook" else None  # (2**bits,) float32
        getattr(lib, f"{kind}_token")(_in(kind, x, column), _ptr(codes.buf), _ptr(scale.buf), _ptr(zero), _ptr(levels),
                                      b, h, r, d, _bits(store), store.group, codes.slots, codes.start, n, ld,
                                      _out(kind, out, column))


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
    held = k_store.held
    ld = held + 1  # one row of scores: every held token, then the new token itself
    qg = k_store.codec.to_space(q.float()).reshape(b, hkv, r, d).contiguous()  # (B, Hkv, R, D), heads sharing a KV head
    s = torch.empty(b, hkv, r, ld)  # (B, Hkv, R, held+1): each part of the cache fills its columns
    column = 0
    for name, n in _pieces(k_store):  # sinks, body, residual: all read in place by the kernels
        call = _body_call if name == "body" else _ring_call
        call("scores", k_store if name == "body" else getattr(k_store, name), qg, column, ld, s)
        column += n
    k_own = k_store.codec.to_space(k.float())  # (B, Hkv, 1, D)
    if k_store.center is not None:
        k_own = k_own - k_store.center.float()  # stored keys are centered: shift the new one alike
    s[..., held:] = qg @ k_own.transpose(-1, -2)  # (B, Hkv, R, 1)
    p = torch.softmax(s / math.sqrt(d), dim=-1)  # (B, Hkv, R, held+1)
    out = p[..., held:] * v_store.codec.to_space(v.float())  # (B, Hkv, R, D): the new token's own value
    column = 0
    for name, n in _pieces(v_store):  # each adds p[..., column:column+n] . V_part to out
        call = _body_call if name == "body" else _ring_call
        call("values", v_store if name == "body" else getattr(v_store, name), p, column, ld, out)
        column += n
    out = v_store.codec.to_space(out)  # back from rotated space, once per query
    cache.count_read(k_store.live_read_bytes() + v_store.live_read_bytes())
    return out.reshape(b, hq, 1, d).to(q.dtype)
