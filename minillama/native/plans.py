"""Decode attention plans: one query token against the packed cache, no dequantized copy.

The same math as ``model/attention.py: attend`` (the reference and test oracle) for T = 1,
but every part of the cache is read in place by the C++ kernels, and the whole layer's
attention is one call (``native/layer_attention.cpp``), because on a small CPU each
PyTorch call costs tens of microseconds. This module only describes the layer to it: each
held part of K and V (``held_parts``: sinks, quantized body, tier, residual) becomes a
``RowSource`` (where its rows live, how to decode them, native/minillama.h) and a route, the
kernel that reads it:

* ``FLOAT``: unquantized rows (sinks, residual, float codecs);
* ``TOKEN`` / ``CHANNEL``: per-token or KIVI per-channel codes, exact float kernels (per-channel
  key scales folded into the query, per-token rows scaled in registers);
* ``INTEGER``: 2-4-bit affine codes scored against an int8 query and weighted by byte weights
  (``native/avx2_int_attention.cpp``; AVX-512 VNNI in ``avx512_vnni_attention.cpp``, which also reads
  codebooks as 16-bit levels, keys in frequency blocks at head_dim 64 with widths up to 4 (with
  VBMI), vector-coded values (by qword gathers, or in registers for a
  sign-structured book), and 8-bit values with int16 weights; AVX2 4-bit keys (affine or
  codebook), 3-bit affine and 2-bit codebook keys in ``avx2_attention.cpp``, AVX2 2-4-bit affine
  and 2-bit codebook values in
  ``avx2_int_values.cpp``; approximate, with a stated bound; the ``kernels-exact`` backend keeps
  the exact kernels). Taken only where it is the faster route: on a CPU without VNNI the exact
  SIMD kernels read the other rows (3- and 4-bit codebook values, 3-bit codebook keys, narrow
  groups) faster (``ops.exact_is_faster``);
* ``ROWS``: keys stored before RoPE (decoded, center added back, rotated for their positions),
  vector codes where no integer kernel reads them, and keys in frequency
  blocks where the integer route does not take them (``native/row_attention.cpp``; the block
  keys' SIMD decode on AVX-512 and AVX2 builds, ``avx512_attention.cpp`` / ``avx2_attention.cpp:
  score_blocks``, which also reads, exactly, a head whose blocks are too wide for the VNNI one).

A part no kernel reads (a codec without ``row_kind``, a shape a kernel does not support)
raises ``NotSupported`` with the reason before anything runs; attention then takes the reference.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable

import torch

from minillama.kv.cache import CacheLayer, KVCache
from minillama.kv.codecs import RowKind
from minillama.kv.store import PartView
from minillama.native import backend, ops
from minillama.native.abi import DTYPE_CODE, MAX_PARTS, STATUS, LayerPlan, NotSupported, Route, RowSource


def held_parts(view: CacheLayer) -> tuple[list[PartView], list[PartView]]:
    """The held parts of one layer's keys and values as their rings hold them (kv/store.py:
    TensorStore.parts), for the kernels that read them in place."""
    first = view.cache.first_rest_position()
    return view.keys.parts(first), view.values.parts(first)


def row_source(
    part: PartView, rope: tuple[torch.Tensor, torch.Tensor] | None, center: torch.Tensor | None, keep: list
) -> RowSource:
    """A RowSource for one held part; `rope` (cos, sin halves) rotates key rows for their positions
    after `center` (B, H, 1, D) is added back. `keep` holds the tensors it points into alive."""
    codec = part.codec
    if codec.row_kind is None:
        raise NotSupported(f"codec {codec.name} declares no kernel row kind")
    src = RowSource(pos0=part.first_position, kind=int(codec.row_kind))
    keep.append(part.rings)  # a cache may hand out buffers made for this read (tests/fakes.py does)
    if codec.row_kind == RowKind.FLOAT:
        ring = part.rings["values"]
        src.bits, src.data, src.slots, src.start = (
            DTYPE_CODE[ring.buf.dtype],
            ring.buf.data_ptr(),
            ring.buf.shape[2],
            ring.start,
        )
    else:
        codes = part.rings["codes"]
        src.bits, src.group = codec.kernel_bits, part.group
        src.data, src.slots, src.start = codes.buf.data_ptr(), codes.buf.shape[2], codes.start
        if "scale" in part.rings:
            scale = part.rings["scale"]
            src.sslots, src.sstart = scale.buf.shape[2], scale.start
            if scale.buf.dtype == torch.uint8:  # one-byte log scales (Codebook.log_scale)
                src.scale8 = scale.buf.data_ptr()
            else:
                src.scale = scale.buf.data_ptr()
            src.zero = part.rings["zero"].buf.data_ptr() if "zero" in part.rings else None
        tables = codec.kernel_tables()
        keep.append(tables)
        if "codebook" in tables:
            src.codebook = tables["codebook"].data_ptr()
        for name, value in codec.kernel_fields().items():  # vector codes: channels per code, patterns
            setattr(src, name, value)
        if "widths" in tables:  # frequency blocks: each head's widths, repeated for every sequence
            per_row = tables["widths"]  # (H, nb)
            sequences = math.prod(codes.buf.shape[:-2]) // per_row.shape[0]  # rows are (B*H, slots, width)
            widths = per_row.repeat(sequences, 1).contiguous()  # (B*H, nb)
            keep.append(widths)
            src.levels = widths.data_ptr()
    if rope is not None:
        if center is not None:
            center = center.float().contiguous()  # (B, H, 1, D)
            keep.append(center)
            src.center = center.data_ptr()
        src.cos, src.sin = rope[0].data_ptr(), rope[1].data_ptr()
    return src


def route(lib, values: bool, part: PartView, src: RowSource, r: int, d: int) -> Route:
    """Which kernel reads this part (see the module docstring); NotSupported when none can."""
    kind = part.codec.row_kind
    if src.cos:
        chosen = Route.ROWS
    elif kind == RowKind.FLOAT:
        chosen = Route.FLOAT
    elif (
        not backend.exact_arithmetic()
        and not ops.exact_is_faster(lib, values, src, d)
        and ops.route_supported(lib, Route.INTEGER, values, src, r, d) == 0
    ):
        return Route.INTEGER
    else:
        chosen = {RowKind.CHANNEL: Route.CHANNEL, RowKind.VECTOR: Route.ROWS, RowKind.BLOCKS: Route.ROWS}.get(
            kind, Route.TOKEN
        )
    status = ops.route_supported(lib, chosen, values, src, r, d)
    if status:
        raise NotSupported(f"{part.codec.name} {part.name} with {r} query heads per KV head of {d}: {STATUS[status]}")
    return chosen


def layer_plan(
    lib,
    view: CacheLayer,
    b: int,
    r: int,
    d: int,
    rope: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None,
    keep: list,
) -> LayerPlan:
    """The parts of one layer of a cache of b sequences as the attention kernel reads them (q, k, v
    and out left for the caller), for r query heads per KV head of size d; NotSupported (nothing
    read) when a part has no kernel that can read it. `keep` holds the tensors the plan points
    into alive."""
    pre = rope is not None
    if view.v_codec.rotation > 1:
        raise NotSupported(f"values in frequency blocks ({view.v_codec.name}): no kernel rotates their output back")
    plan = LayerPlan(B=b, R=r, D=d, rotate_k=0 if pre else view.k_codec.rotation, rotate_v=view.v_codec.rotation)
    if view.key_center is not None and not pre:  # stored keys are centered: shift the new one alike
        center = view.key_center.float().contiguous()  # (B, H, 1, D)
        keep.append(center)
        plan.k_center = center.data_ptr()
    k_parts, v_parts = held_parts(view)
    angles = rope(max(p.first_position + p.n for p in k_parts)) if pre and k_parts else None
    keep.append(angles)
    for values, parts, slots, count in ((False, k_parts, plan.kparts, "nk"), (True, v_parts, plan.vparts, "nv")):
        setattr(plan, count, len(parts))
        for i, part in enumerate(parts):
            src = row_source(part, None if values else angles, None if values else view.key_center, keep)
            slots[i].route, slots[i].n, slots[i].src = route(lib, values, part, src, r, d), part.n, src
    return plan


def decode_plan(
    lib,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    view: CacheLayer,
    rope: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None,
    keep: list,
) -> LayerPlan:
    """The whole call for one decode token: the layer's parts (``layer_plan``) plus q (B, Hq, 1, D),
    the new k, v (B, Hkv, 1, D) and out (B, Hq, 1, D), all contiguous in one dtype the kernel takes."""
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    plan = layer_plan(lib, view, b, hq // hkv, d, rope, keep)
    plan.H, plan.dtype = hkv, DTYPE_CODE[q.dtype]
    plan.q, plan.k, plan.v, plan.out = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
    keep += [q, k, v, out]
    return plan


def fused_decode_attention(
    lib,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    view: CacheLayer,
    rope: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """q (B, Hq, 1, D) and the new k (after RoPE), v (B, Hkv, 1, D) -> (B, Hq, 1, D); the same result
    as the reference attention over view.read(). For keys stored before RoPE, ``rope(n)`` gives
    (cos, sin), each (n' >= n, D/2), the angles of positions 0..n-1 (model/rope.py: RotaryTable.halves)."""
    dtype = q.dtype if q.dtype in DTYPE_CODE else torch.float32
    q, k, v = (x.to(dtype).contiguous() for x in (q, k, v))
    out = torch.empty_like(q)  # (B, Hq, 1, D)
    keep: list = []
    ops.attend_layer(lib, decode_plan(lib, q, k, v, out, view, rope, keep))
    backend.ran("decode attention")
    return out


def attend_one_part(
    lib, values: bool, part: PartView, x: torch.Tensor, out: torch.Tensor, via: Route | None = None
) -> Route:
    """One held part alone through the kernel attend_layer would route it to, or through `via`
    (tests): scores of x = q (B, H, R, D) into out (B, H, R, n), or
    p = x (B, H, R, n) weighting the part's rows, added to out (B, H, R, D). Returns the route taken."""
    keep: list = []
    src = row_source(part, None, None, keep)
    r, d = x.shape[2], out.shape[-1] if values else x.shape[-1]
    chosen = route(lib, values, part, src, r, d) if via is None else via
    ops.attend_part(lib, values, chosen, x, 0, src, r, d, part.n, part.n, out)
    return chosen


class CachePlans:
    """Every layer's plan for one ``KVCache``, built once and refreshed in place at each step.

    What a plan points at -- ring buffers, codec tables, the key center -- stays put while a cache
    lives (rings never move), so it is described once; what a step changes is each part's token
    count, the slot of its oldest row and its first position, the same numbers for every layer
    that shares a codec (kv/layered.py). A group's plans are made again only when its parts
    appear (sinks, body, tier, residual start out empty), the key center is set or the cache is
    cleared: a group's shape in ``refresh`` (which parts hold tokens, the center, the RoPE tables,
    the exact switch) names all of that. `keep` holds
    alive every tensor the plans point into."""

    def __init__(self, lib, cache: KVCache, r: int):
        self.lib, self.r, self.d = lib, r, cache.head_dim
        self.plans: list[LayerPlan | None] = [None] * cache.n_layers
        self.keep: list[list] = [[] for _ in range(cache.n_layers)]
        self.shapes: list[tuple | None] = [None] * len(cache.stores)
        self.members: list = [None] * len(cache.stores)  # per group: its layers' plan pointers
        self.batched: dict[tuple[int, ...], ctypes.Array] = {}  # groups placed alike: their plans' pointers together
        self.live = (ctypes.c_int * (4 * MAX_PARTS))()  # (n, start, scale start, first position) per part
        self.cursors = [_part_cursors(shared) for shared in cache.stores]

    @staticmethod
    def _same(a: tuple | None, b: tuple) -> bool:
        """Shapes are the same: equal flags, and the very same center object (held here, so a new one
        can never reuse a freed one's identity)."""
        return a is not None and a[0] == b[0] and a[1] is b[1] and a[2:] == b[2:]

    def refresh(
        self, cache: KVCache, rope: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None
    ) -> list[LayerPlan]:
        """The plans for `cache` (the one they were made for) as it is now; NotSupported when a part
        has no kernel."""
        first_rest = cache.first_rest_position()
        tables = None
        if rope is not None and cache.held:
            tables = rope(cache.position)  # (cos, sin): every held key's position is below the next token's
            tables = (tables[0].data_ptr(), tables[1].data_ptr())
        exact = backend.exact_arithmetic()
        lives, shapes, stale = [], [], set()
        for g, (shared, cursors) in enumerate(zip(cache.stores, self.cursors)):
            live = []  # (n, start, scale start, first position) of each held part, in order
            present = []
            position = first_rest
            for sinks, count, per_row, data, scale in cursors:  # sinks, body, (tier,) residual
                n = count.count * per_row
                present.append(n > 0)
                if n:
                    live += (n, data.start, scale.start if scale is not None else 0, 0 if sinks else position)
                if not sinks:
                    position += n
            lead = shared.stores[0]
            shape = (tuple(present), lead.center, tables, exact)
            if not self._same(self.shapes[g], shape):
                stale.update(shared.layers)
            lives.append(tuple(live))
            shapes.append(shape)
        for i in sorted(stale):  # made again from the layer's parts, as layer_plan describes them
            keep: list = []
            self.plans[i] = layer_plan(self.lib, cache.layer(i), cache.batch, self.r, self.d, rope, keep)
            self.keep[i] = keep
        for g, shared in enumerate(cache.stores):
            if stale.intersection(shared.layers) or self.members[g] is None:
                self.members[g] = [ctypes.pointer(self.plans[i]) for i in shared.layers]
                self.batched.clear()
        self.shapes = shapes
        # The groups whose parts are counted and placed alike (in a mix, every codec whose rings
        # have one layout) get their plans set by one call.
        alike: dict[tuple, list[int]] = {}
        for g, (t, live) in enumerate(zip(cache.tensor_of, lives)):
            alike.setdefault((t, live), []).append(g)
        for (t, live), groups in alike.items():
            plans = self.batched.get(tuple(groups))
            if plans is None:
                pointers = [p for g in groups for p in self.members[g]]
                plans = self.batched[tuple(groups)] = (ctypes.POINTER(LayerPlan) * len(pointers))(*pointers)
            self.live[: len(live)] = live
            ops.set_parts(self.lib, plans, bool(t), self.live, len(live) // 4)
        return self.plans


def _part_cursors(shared) -> list[tuple]:
    """A group's parts in age order, each as (sinks?, the cursor that counts its rows, tokens a
    row, its data ring's cursor, its scale ring's or None): what a step reads to place them."""
    lead = shared.stores[0]

    def part(sinks: bool, rings: dict, per_row: int, count=None) -> tuple:
        data = rings["values"] if "values" in rings else rings["codes"]
        scale = rings["scale"].cursor if "scale" in rings else None
        return sinks, (count or data).cursor, per_row, data.cursor, scale

    first = next(iter(lead.body))  # the body's parts hold alike: the first counts its tokens
    parts = [
        part(True, {"values": lead.sinks}, 1),
        part(False, lead.body, lead.tokens_per_row[first], lead.body[first]),
    ]
    if lead.tier:
        parts.append(part(False, lead.tier, 1))
    return [*parts, part(False, {"values": lead.residual}, 1)]
