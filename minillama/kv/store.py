"""One tensor (K or V) of one layer in the cache: sinks, quantized body and residual.

Layout, in age order:

    [ sinks | quantized body (ring) | full-precision residual (ring) ]

* **sinks**: the first ``sinks`` tokens, kept exact forever (attention sinks, StreamingLLM).
* **body**: packed codes + fp16 scales/zeros written by the codec (``codecs.py``).
* **residual**: the most recent tokens in full precision. A token leaves the residual only
  when ``residual + unit`` tokens wait there, and then ``unit`` of them are quantized at
  once (unit = the group size for KIVI per-channel keys, 1 otherwise), so the residual
  holds between ``residual`` and ``residual + unit - 1`` tokens.

Everything is kept in the codec's storage space (Hadamard-rotated for ``*h`` codecs;
attention undoes that once per query). With ``center=1`` in the spec, keys are stored
minus a per-channel mean taken once per sequence from the first tokens written (B, H, 1,
D; counted with the scales). Attention is unchanged by it: q.(k_t - m) = q.k_t - q.m
shifts every score of a query by the same amount, which softmax ignores, as long as the
new keys are shifted too (``KVCache.key_center``). What changes is quantization: the
large, nearly constant key channels of Llama models no longer inflate each token's range,
so per-token (rotated) key codes get finer.

With ``start=N`` nothing leaves the residual until N tokens are held. Calibrated codecs
(``int4cs``, ``nuq3``, ...) fit their per-sequence parameters on the first flush: every
non-sink token held at that moment (the prefill, or the first N with ``start=N``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillama.kv.codecs import Codec, exact_codec
from minillama.kv.interface import PartView
from minillama.kv.ring import Ring
from minillama.kv.spec import KVSpec
from minillama.kv.write import encode, storage_form


@dataclass(frozen=True)
class RingShape:
    """One ring buffer per (sequence, KV head): `slots` rows of `width` elements."""

    slots: int
    width: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.slots * self.width * self.dtype.itemsize


def residual_slots(codec: Codec, group: int, spec: KVSpec) -> int:
    """The residual holds up to R + unit - 1 tokens, or everything held below start=N."""
    if not (codec.quantized or spec.residual):
        return 0
    return max(spec.residual + codec.unit(group) - 1, spec.start)


def layout(codec: Codec, group: int, spec: KVSpec, capacity: int, head_dim: int) -> dict[str, RingShape]:
    """The rings one tensor of one layer preallocates: sinks, residual and the body's parts.

    The body holds the rest of the capacity, in rows of ``tokens_per_row`` tokens per part."""
    exact = codec.exact_dtype
    shapes = {
        "sinks": RingShape(spec.sinks, head_dim, exact),
        "residual": RingShape(residual_slots(codec, group, spec), head_dim, exact),
    }
    body_tokens = capacity - spec.sinks - spec.residual
    for p in codec.parts(head_dim, group):
        shapes[p.name] = RingShape(body_tokens // p.tokens_per_row, p.width, p.dtype)
    return shapes


def allocation_bytes(codec: Codec, group: int, spec: KVSpec, capacity: int, head_dim: int) -> int:
    """Bytes one tensor of one layer allocates per (sequence, KV head): the closed form of
    ``TensorStore.allocated_bytes`` before any per-sequence parameter (key center, ranges) exists."""
    return sum(shape.nbytes for shape in layout(codec, group, spec, capacity, head_dim).values())


class TensorStore:
    """Sinks, quantized body and residual for one tensor (K or V) of one layer."""

    def __init__(
        self,
        codec: Codec,
        group: int,
        spec: KVSpec,
        capacity: int,
        batch: int,
        heads: int,
        head_dim: int,
        device,
        centered: bool = False,
    ):
        self.codec, self.group, self.head_dim = codec, group, head_dim
        self.centered = centered
        self.center: torch.Tensor | None = (
            None  # (B, H, 1, D) per-channel mean in storage space, set by the first append
        )
        self.params: dict[str, torch.Tensor] | None = None  # calib codecs: lo, span (B, H, 1, D), levels (B, H, 2**b)
        self.residual_len, self.unit, self.start = spec.residual, codec.unit(group), spec.start
        rings = {
            name: Ring(batch, heads, shape.slots, shape.width, shape.dtype, device)  # (B, H, slots, width)
            for name, shape in layout(codec, group, spec, capacity, head_dim).items()
        }
        self.sinks = rings.pop("sinks")  # (B, H, S, D)
        self.residual = rings.pop("residual")  # (B, H, R+unit-1, D)
        self.body = rings  # part name -> (B, H, rows, width)
        self.tokens_per_row = {p.name: p.tokens_per_row for p in codec.parts(head_dim, group)}
        self.n_body = 0  # tokens in the body

    @property
    def held(self) -> int:
        return self.sinks.count + self.n_body + self.residual.count

    def _drop_body(self, n: int, newest: bool = False) -> None:
        for name, ring in self.body.items():
            rows = n // self.tokens_per_row[name]
            ring.drop_newest(rows) if newest else ring.drop_oldest(rows)
        self.n_body -= n

    def take(self, x: torch.Tensor, evict: int) -> tuple[torch.Tensor | None, torch.Tensor, int, int]:
        """First half of an append of x (B, H, n, D), already in storage form: fill the sinks,
        evict `evict` oldest non-sink tokens, and split off the block to quantize now.

        Returns (block to encode (B, H, n_flush, D) or None, tokens for the residual,
        bytes written, bytes read); ``put`` finishes the append.
        """
        written = read = 0
        take = min(self.sinks.slots - self.sinks.count, x.shape[2])
        if take:
            written += self.sinks.push(x[:, :, :take])
            x = x[:, :, take:]
        # Evict the oldest tokens: from the body, then the residual, then the new ones.
        from_body = min(evict, self.n_body)
        self._drop_body(from_body)
        from_res = min(evict - from_body, self.residual.count)
        self.residual.drop_oldest(from_res)
        x = x[:, :, evict - from_body - from_res :]
        # Quantize whole units once residual + unit tokens are waiting (and start=N tokens are held).
        waiting = self.residual.count + x.shape[2]
        n_flush = max(0, (waiting - self.residual_len) // self.unit * self.unit)
        if self.sinks.count + self.n_body + waiting < self.start:
            n_flush = 0
        if not n_flush:
            return None, x, written, read
        old = self.residual.read(0, min(n_flush, self.residual.count))  # (B, H, r, D)
        read += old.shape[2] * self.residual.row_bytes
        self.residual.drop_oldest(old.shape[2])
        n_new = n_flush - old.shape[2]
        block = torch.cat([old, x[:, :, :n_new]], dim=2) if old.shape[2] else x[:, :, :n_new]  # (B, H, n_flush, D)
        return block, x[:, :, n_new:], written, read

    def put(self, parts: dict[str, torch.Tensor] | None, n_flush: int, rest: torch.Tensor) -> int:
        """Second half of an append: store the encoded block and the residual tokens; bytes written."""
        written = 0
        if parts is not None:
            for name, part in parts.items():
                written += self.body[name].push(part)
            self.n_body += n_flush
        if rest.shape[2]:
            written += self.residual.push(rest)
        return written

    @property
    def center_bytes(self) -> int:
        """Bytes of the per-sequence parameters: the key center, a calibrated codec's ranges and grid."""
        stored = dict(self.codec.stored_params(self.params)) if self.params else {}
        if self.center is not None:
            stored["center"] = self.center
        return sum(t.numel() * t.element_size() for t in stored.values())

    def live_read_bytes(self) -> int:
        """Bytes a full read of the held tokens touches (sinks, body parts, residual, key center)."""
        return (
            self.sinks.live_bytes
            + sum(r.live_bytes for r in self.body.values())
            + self.residual.live_bytes
            + self.center_bytes
        )

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        """All held vectors in age order, (B, H, held, D) in storage space; and bytes read."""
        pieces = []
        if self.sinks.count:
            pieces.append(self.sinks.read())
        if self.n_body:
            parts = {name: ring.read() for name, ring in self.body.items()}
            pieces.append(
                parts["values"]
                if "values" in parts
                else self.codec.decode(parts, self.group, self.head_dim, self.params)
            )
        if self.residual.count:
            pieces.append(self.residual.read())
        nbytes = self.live_read_bytes()
        if len(pieces) == 1:
            return pieces[0].to(dtype), nbytes
        if not pieces:
            return self.sinks.buf[:, :, :0].to(dtype), 0
        return torch.cat([p.to(dtype) for p in pieces], dim=2), nbytes

    def parts(self, first_rest: int) -> list[PartView]:
        """The held parts in age order (sinks, body, residual), each with the position of its first
        token: sinks from 0, the rest consecutive from `first_rest` (the cache knows it)."""
        positions = (0, first_rest, first_rest + self.n_body)
        exact = exact_codec(self.residual.buf.dtype)
        held = [
            ("sinks", self.sinks.count, exact, {"values": self.sinks.view()}, None),
            ("body", self.n_body, self.codec, {name: ring.view() for name, ring in self.body.items()}, self.params),
            ("residual", self.residual.count, exact, {"values": self.residual.view()}, None),
        ]
        return [
            PartView(name, n, first, codec, self.group, rings, params)
            for (name, n, codec, rings, params), first in zip(held, positions)
            if n
        ]

    def keep_newest_limit(self, n_nonsink: int) -> int:
        """Largest m <= n_nonsink such that the oldest m non-sink tokens can be kept exactly."""
        if n_nonsink >= self.n_body:
            return n_nonsink
        return n_nonsink // self.unit * self.unit  # a per-channel group cannot be cut

    def truncate_nonsink(self, m: int) -> None:
        """Keep only the oldest m non-sink tokens (m from keep_newest_limit)."""
        drop = self.n_body + self.residual.count - m
        from_res = min(drop, self.residual.count)
        self.residual.drop_newest(from_res)
        self._drop_body(drop - from_res, newest=True)

    def clear(self) -> None:
        for ring in [self.sinks, self.residual, *self.body.values()]:
            ring.clear()
        self.n_body = 0
        self.center = None
        self.params = None

    def live_bytes(self) -> dict[str, int]:
        codes = sum(r.live_bytes for n, r in self.body.items() if n in ("codes", "values"))
        scales = sum(r.live_bytes for n, r in self.body.items() if n in ("scale", "zero")) + self.center_bytes
        return {"codes": codes, "scales": scales, "residual": self.residual.live_bytes, "sinks": self.sinks.live_bytes}

    def allocated_bytes(self) -> int:
        return sum(r.allocated_bytes for r in [self.sinks, self.residual, *self.body.values()]) + self.center_bytes


def append_layers(stores: list[TensorStore], xs: list[torch.Tensor], evict: int) -> tuple[int, int]:
    """Store new vectors xs[i] (B, H, n, D) in stores[i], the same tensor (K or V) of every layer
    at once, after evicting `evict` oldest non-sink tokens; returns (bytes written, bytes read).

    All layers hold the same number of tokens, so they evict and flush the same tokens in
    the same step; stacking them lets one rotation and one ``encode`` call do the work of
    one per layer (a decode step would otherwise pay ~30 small PyTorch ops per layer).
    Results are identical to appending layer by layer (the codecs work per row and group).
    """
    codec = stores[0].codec
    x = torch.stack(xs)  # (L, B, H, n, D), in the model's dtype
    exact = stores[0].residual.buf.dtype
    if stores[0].centered and stores[0].center is None:  # the first append sets each layer's center
        means = codec.to_space(x).float().mean(dim=-2, keepdim=True).to(exact)  # (L, B, H, 1, D)
        for store, m in zip(stores, means):
            store.center = m
    center = torch.stack([s.center for s in stores]) if stores[0].centered else None  # (L, B, H, 1, D)
    # Everything enters in the exact dtype (fp16 for quantized codecs), so a token is
    # quantized from the same values whether or not it waited in the residual.
    x = storage_form(codec, x, center, exact)
    written = read = 0
    taken = []
    for store, xi in zip(stores, x):
        block, rest, w, r = store.take(xi, evict)
        taken.append((block, rest))
        written, read = written + w, read + r
    parts_per_layer = [None] * len(stores)
    n_flush = 0
    if taken[0][0] is not None:
        blocks = torch.stack([block for block, _ in taken])  # (L, B, H, n_flush, D)
        n_layers, b, h, n_flush, d = blocks.shape
        if codec.per_sequence and stores[0].params is None:  # the first flush fits the per-sequence ranges
            held = torch.stack([torch.cat([block, rest], dim=2) for block, rest in taken])  # (L, B, H, n, D)
            params = codec.calibrate(held.reshape(n_layers * b, h, *held.shape[3:]))  # each (L*B, H, ...)
            for i, store in enumerate(stores):
                store.params = {name: p.reshape(n_layers, b, *p.shape[1:])[i] for name, p in params.items()}
        params = None
        if codec.per_sequence:
            params = {
                name: torch.stack([s.params[name] for s in stores]).reshape(
                    n_layers * b, *stores[0].params[name].shape[1:]
                )
                for name in stores[0].params
            }
        parts = encode(
            codec, blocks.reshape(n_layers * b, h, n_flush, d), stores[0].group, params
        )  # (L*B, H, rows, width)
        parts = {name: p.reshape(n_layers, b, *p.shape[1:]) for name, p in parts.items()}  # each (L, B, H, rows, width)
        parts_per_layer = [{name: p[i] for name, p in parts.items()} for i in range(n_layers)]
    for store, (_, rest), parts_i in zip(stores, taken, parts_per_layer):
        written += store.put(parts_i, n_flush, rest)
    return written, read
