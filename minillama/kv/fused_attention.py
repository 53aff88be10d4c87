"""Fused decode attention: one query token against the packed cache, no dequantized copy.

The same math as ``model/attention.py: attend`` (the reference and test oracle) for T = 1,
but every part of the cache is read in place by the C++ kernels, and the whole layer's
attention is one call (``kernels/layer_attention.cpp``), because on a small CPU each
PyTorch call costs tens of microseconds. This module only describes the cache to it: for
K and V, each held part (sinks, quantized body, residual) becomes a ``RowSource`` (where
its rows live, how to decode them) and a route, the kernel that reads it:

* ``FLOAT_RING``: unquantized rows (sinks, residual, float codecs), ``decode_attention.cpp``;
* ``TOKEN`` / ``CHANNEL``: per-token or KIVI per-channel codes, exact float kernels
  (per-channel key scales folded into the query, per-token rows scaled in registers);
* ``INTEGER``: 2-4-bit affine codes scored against an int8 query and weighted by byte
  weights (``int_attention.cpp``, AVX2; approximate, with a stated bound;
  ``MINILLAMA_EXACT_ATTENTION=1`` routes them to the exact kernels instead);
* ``ROWS``: keys stored before RoPE (decoded, center added back, rotated for their
  positions) and calibrated codecs (``row_attention.cpp``).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from minillama.kv.cache import KVCache
from minillama.kv.kernels import load
from minillama.kv.quantize import gaussian_codebook
from minillama.kv.store import TensorStore

FLOAT_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
ROW_KIND = {"float": 0, "token": 1, "ternary": 1, "codebook": 1, "channel": 2, "calib": 3}
FLOAT_RING, TOKEN, CHANNEL, INTEGER, ROWS = range(5)


class RowSource(ctypes.Structure):
    """Where one part's rows live and how to decode them (kernels/rows.h: struct RowSource)."""

    _fields_ = [("kind", ctypes.c_int), ("bits", ctypes.c_int), ("group", ctypes.c_int), ("data", ctypes.c_void_p),
                ("slots", ctypes.c_int), ("start", ctypes.c_int), ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p),
                ("sslots", ctypes.c_int), ("sstart", ctypes.c_int), ("codebook", ctypes.c_void_p), ("lo", ctypes.c_void_p),
                ("span", ctypes.c_void_p), ("levels", ctypes.c_void_p), ("nlevels", ctypes.c_int),
                ("center", ctypes.c_void_p), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("pos0", ctypes.c_int)]


class Part(ctypes.Structure):
    _fields_ = [("route", ctypes.c_int), ("n", ctypes.c_int), ("src", RowSource)]


class LayerPlan(ctypes.Structure):
    """One layer's decode attention (kernels/layer_attention.cpp: struct LayerPlan)."""

    _fields_ = [("B", ctypes.c_int), ("H", ctypes.c_int), ("R", ctypes.c_int), ("D", ctypes.c_int),
                ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("dtype", ctypes.c_int),
                ("rotate_k", ctypes.c_int), ("rotate_v", ctypes.c_int), ("k_center", ctypes.c_void_p),
                ("nk", ctypes.c_int), ("nv", ctypes.c_int), ("kparts", Part * 3), ("vparts", Part * 3),
                ("out", ctypes.c_void_p)]


def available(cache: KVCache) -> bool:
    return cache.fused and load() is not None


@functools.lru_cache(maxsize=1)
def int_available() -> bool:
    lib = load()
    return lib is not None and bool(lib.int_attention_available())


def integer_path(kind: str, store: TensorStore) -> bool:
    """Whether the body of `store` is read by the integer-domain kernels (int_attention.cpp): 2-4-bit
    affine codes with one scale per row (scores: per-token with group == D, or KIVI per-channel;
    values: per-token with group == D or 32). MINILLAMA_EXACT_ATTENTION=1 keeps the exact float kernels."""
    codec, d = store.codec, store.head_dim
    if os.environ.get("MINILLAMA_EXACT_ATTENTION", "0") == "1" or not int_available():
        return False
    if codec.bits not in (2, 3, 4) or d % 32 or d > 128:
        return False
    if kind == "scores":
        return codec.kind == "channel" or (codec.kind == "token" and store.group == d)
    return codec.kind == "token" and store.group in (d, 32)


def _bits(store: TensorStore) -> int:
    return 5 if store.codec.kind == "ternary" else store.codec.bits


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
            center = store.center.float().contiguous()  # (B, H, 1, D)
            keep.append(center)
            src.center = center.data_ptr()
        src.cos, src.sin = rope[0].data_ptr(), rope[1].data_ptr()
    return src


def route(kind: str, store: TensorStore, part: str, rope) -> int:
    """Which kernel reads this part (see the module docstring)."""
    if rope is not None or (part == "body" and store.codec.kind == "calib"):
        return ROWS
    if part != "body" or store.codec.kind == "float":
        return FLOAT_RING
    if integer_path(kind, store):
        return INTEGER
    return CHANNEL if store.codec.kind == "channel" else TOKEN


def _pieces(store: TensorStore) -> list[tuple[str, int]]:
    """The store's held tokens in age order, as (part, count): sinks, body, residual."""
    parts = [("sinks", store.sinks.count), ("body", store.n_body), ("residual", store.residual.count)]
    return [(name, n) for name, n in parts if n]


def _part_call(kind: str, store: TensorStore, part: str, n: int, x: torch.Tensor, column: int, ld: int,
               out: torch.Tensor, rope, pos0: int) -> None:
    """One part of `store` through its kernel, alone (tests and bench/attention_micro.py). kind "scores":
    x = q (B, H, R, D) in the key codec's space, the scores go to columns [column, column + n) of out
    (rows ld apart); kind "values": columns from `column` of x = p weight the part's rows, added to
    out (B, H, R, D)."""
    keep: list = []
    src = row_source(store, part, rope, pos0, keep)
    b, h, r = x.shape[:3]
    values = kind == "values"
    x_ptr = x.data_ptr() + (4 * column if values else 0)
    out_ptr = out.data_ptr() + (0 if values else 4 * column)
    load().attend_part(int(values), route(kind, store, part, rope), ctypes.c_void_p(x_ptr), ctypes.byref(src), b, h, r,
                       store.head_dim, n, ld, ctypes.c_void_p(out_ptr))


def fused_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int,
                           rotary=None) -> torch.Tensor:
    """q (B, Hq, 1, D) and the new k (after RoPE), v (B, Hkv, 1, D) -> (B, Hq, 1, D); the same result
    as the reference attention over cache.read(). ``rotary`` (model/rope.py: RotaryTable) rotates keys
    stored before RoPE for their positions."""
    k_store, v_store = cache.layers[layer]
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    pre = cache.pre_rope
    rope = None
    if pre:
        last = k_store.held if cache.spec.positions == "cache" else cache.position  # the largest position held
        rope = rotary.halves(last + 1)  # (positions, D/2) cos and sin
    starts = dict(zip(("sinks", "body", "residual"), cache.part_positions()))
    dtype = q.dtype if q.dtype in FLOAT_CODE else torch.float32
    q, k, v = (x.to(dtype).contiguous() for x in (q, k, v))
    out = torch.empty(b, hq, 1, d, dtype=dtype)  # (B, Hq, 1, D)
    keep: list = []
    plan = LayerPlan(B=b, H=hkv, R=hq // hkv, D=d, q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(),
                     dtype=FLOAT_CODE[dtype], rotate_k=int(k_store.codec.rotate and not pre),
                     rotate_v=int(v_store.codec.rotate), out=out.data_ptr())
    if k_store.center is not None and not pre:  # stored keys are centered: shift the new one alike
        center = k_store.center.float().contiguous()  # (B, H, 1, D)
        keep.append(center)
        plan.k_center = center.data_ptr()
    for kind, store, parts, count in (("scores", k_store, plan.kparts, "nk"), ("values", v_store, plan.vparts, "nv")):
        pieces = _pieces(store)
        setattr(plan, count, len(pieces))
        for i, (name, n) in enumerate(pieces):
            r = rope if kind == "scores" else None
            parts[i].route, parts[i].n = route(kind, store, name, r), n
            parts[i].src = row_source(store, name, r, starts[name], keep)
    load().attend_layer(ctypes.byref(plan))
    cache.count_read(k_store.live_read_bytes() + v_store.live_read_bytes())
    return out
