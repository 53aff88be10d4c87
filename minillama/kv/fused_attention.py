"""Fused decode attention: one query token against the packed cache, no dequantized copy.

The same math as ``model/attention.py: attend`` (the reference and test oracle) for T = 1,
but every part of the cache is read in place by the C++ kernels: the quantized body
(``kernels/decode_attention.cpp``: per-channel key scales folded into the query, per-token
rows unpacked and scaled in registers), and the exact sinks and residual (fp16 rings).
Keys stored before RoPE and calibrated codecs go through ``kernels/row_attention.cpp``,
which decodes each row, adds the key center back and rotates it for its position. Each
part writes its columns of one score matrix, so nothing is concatenated; only the new
token's own key and value use PyTorch ops.
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
ROW_KIND = {"float": 0, "token": 1, "ternary": 1, "codebook": 1, "channel": 2, "calib": 3}


class RowSource(ctypes.Structure):
    """Where one part's rows live and how to decode them (row_attention.cpp's struct RowSource)."""

    _fields_ = [("kind", ctypes.c_int), ("bits", ctypes.c_int), ("group", ctypes.c_int), ("data", ctypes.c_void_p),
                ("slots", ctypes.c_int), ("start", ctypes.c_int), ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p),
                ("sslots", ctypes.c_int), ("sstart", ctypes.c_int), ("codebook", ctypes.c_void_p), ("lo", ctypes.c_void_p),
                ("span", ctypes.c_void_p), ("levels", ctypes.c_void_p), ("nlevels", ctypes.c_int),
                ("center", ctypes.c_void_p), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("pos0", ctypes.c_int)]


def row_source(store: TensorStore, part: str, rope: tuple[torch.Tensor, torch.Tensor] | None, pos0: int,
               keep: list) -> RowSource:
    """A RowSource for a part of `store` ("sinks", "body", "residual"); `rope` (cos, sin halves) rotates
    key rows for their positions (from pos0) after the center is added back. `keep` holds tensors alive."""
    src = RowSource(pos0=pos0)
    if part != "body" or store.codec.kind == "float":
        ring = getattr(store, part) if part != "body" else store.body["values"]
        src.kind, src.bits, src.data = 0, FLOAT_CODE[ring.buf.dtype], ring.buf.data_ptr()
        src.slots, src.start = ring.slots, ring.start
    else:
        codec, codes = store.codec, store.body["codes"]
        src.kind, src.bits, src.group = ROW_KIND[codec.kind], _bits(store), store.group
        src.data, src.slots, src.start = codes.buf.data_ptr(), codes.slots, codes.start
        if "scale" in store.body:
            scale = store.body["scale"]
            src.scale, src.sslots, src.sstart = scale.buf.data_ptr(), scale.slots, scale.start
            src.zero = store.body["zero"].buf.data_ptr() if "zero" in store.body else None
        if codec.kind == "codebook":
            levels = gaussian_codebook(codec.bits)
            keep.append(levels)
            src.codebook = levels.data_ptr()
        if codec.kind == "calib":
            params = {name: t.contiguous() for name, t in store.params.items()}
            keep.append(params)
            src.lo, src.span, src.levels = (params[n].data_ptr() for n in ("lo", "span", "levels"))
            src.nlevels = params["levels"].shape[-1]
    if rope is not None:
        if store.center is not None:
            center = store.center.contiguous()
            keep.append(center)
            src.center = center.data_ptr()
        src.cos, src.sin = rope[0].data_ptr(), rope[1].data_ptr()
    return src


def _rows_call(kind: str, store: TensorStore, part: str, n: int, x: torch.Tensor, column: int, ld: int,
               out: torch.Tensor, rope, pos0: int) -> None:
    """The row-at-a-time kernel over one part (n tokens) of `store`; see _body_call for x, column and out."""
    keep: list = []
    src = row_source(store, part, rope, pos0, keep)
    b, h, r = x.shape[:3]
    getattr(load(), f"{kind}_rows")(_in(kind, x, column), ctypes.byref(src), b, h, r, store.head_dim, n, ld,
                                    _out(kind, out, column))


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


def _part_call(kind: str, store: TensorStore, part: str, n: int, x: torch.Tensor, column: int, ld: int,
               out: torch.Tensor, rope, pos0: int) -> None:
    """One part of one tensor into its columns of the score matrix (or added to the output)."""
    if rope is not None or (part == "body" and store.codec.kind == "calib"):
        _rows_call(kind, store, part, n, x, column, ld, out, rope, pos0)
    elif part == "body":
        _body_call(kind, store, x, column, ld, out)
    else:
        _ring_call(kind, getattr(store, part), x, column, ld, out)


def fused_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int,
                           rotary=None) -> torch.Tensor:
    """q (B, Hq, 1, D) and the new k (after RoPE), v (B, Hkv, 1, D) -> (B, Hq, 1, D); the same result
    as the reference attention over cache.read(). ``rotary`` (model/rope.py: RotaryTable) rotates keys
    stored before RoPE for their positions."""
    k_store, v_store = cache.layers[layer]
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    r = hq // hkv
    held = k_store.held
    ld = held + 1  # one row of scores: every held token, then the new token itself
    pre = cache.pre_rope
    last = held if cache.spec.positions == "cache" else cache.position  # the largest position a held key has
    rope = rotary.halves(last + 1) if pre else None  # (positions, D/2) cos and sin
    starts = dict(zip(("sinks", "body", "residual"), cache.part_positions()))
    key_space = (lambda x: x) if pre else k_store.codec.to_space  # pre-RoPE keys are never rotated
    qg = key_space(q.float()).reshape(b, hkv, r, d).contiguous()  # (B, Hkv, R, D), heads sharing a KV head
    s = torch.empty(b, hkv, r, ld)  # (B, Hkv, R, held+1): each part of the cache fills its columns
    column = 0
    for name, n in _pieces(k_store):  # sinks, body, residual: all read in place by the kernels
        _part_call("scores", k_store, name, n, qg, column, ld, s, rope, starts[name])
        column += n
    k_own = key_space(k.float())  # (B, Hkv, 1, D)
    if k_store.center is not None and not pre:
        k_own = k_own - k_store.center.float()  # stored keys are centered: shift the new one alike
    s[..., held:] = qg @ k_own.transpose(-1, -2)  # (B, Hkv, R, 1)
    p = torch.softmax(s / math.sqrt(d), dim=-1)  # (B, Hkv, R, held+1)
    out = p[..., held:] * v_store.codec.to_space(v.float())  # (B, Hkv, R, D): the new token's own value
    column = 0
    for name, n in _pieces(v_store):  # each adds p[..., column:column+n] . V_part to out
        _part_call("values", v_store, name, n, p, column, ld, out, None, 0)
        column += n
    out = v_store.codec.to_space(out)  # back from rotated space, once per query
    cache.count_read(k_store.live_read_bytes() + v_store.live_read_bytes())
    return out.reshape(b, hq, 1, d).to(q.dtype)
