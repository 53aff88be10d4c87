"""One tensor (K or V) of one layer in the cache: sinks, quantized body, tier and residual.

Layout, in age order:

    [ sinks | quantized body (ring) | tier (ring) | full-precision residual (ring) ]

* **sinks**: the first ``sinks`` tokens, kept exact forever (attention sinks, StreamingLLM).
* **body**: packed codes + fp16 scales/zeros written by the codec (``codecs.py``).
* **residual**: the most recent tokens in full precision. A token leaves the residual only
  when ``residual + unit`` tokens wait there, and then ``unit`` of them are quantized at
  once (unit = the group size for KIVI per-channel keys, 1 otherwise), so the residual
  holds between ``residual`` and ``residual + unit - 1`` tokens.
* **tier** (``tier=N:CODEC`` in the spec; none by default): the N tokens just older than the
  residual, in a finer per-token codec than the body (e.g. 4-bit ``lm4hb`` beside a 2-3-bit
  body). With a tier, a token leaving the residual is coded into the tier (the residual then
  holds exactly ``residual`` tokens), and once ``N + unit`` wait in the tier its oldest whole
  units are decoded and coded again into the body: they are rounded twice, the price of
  holding the recent tokens finer without keeping them exact. Tokens that go straight to the
  body in one append (a prefill) are coded once, from their exact values.

Everything is kept in the codec's storage space (Hadamard-rotated for ``*h`` codecs;
attention undoes that once per query). With ``center=1`` in the spec, keys are stored
minus a per-channel mean taken once per sequence from the first tokens written (B, H, 1,
D; counted with the scales). Attention is unchanged by it: q.(k_t - m) = q.k_t - q.m
shifts every score of a query by the same amount, which softmax ignores, as long as the
new keys are shifted too (``KVCache.key_center``). What changes is quantization: the
large, nearly constant key channels of Llama models no longer inflate each token's range,
so per-token (rotated) key codes get finer.

With ``start=N`` nothing leaves the residual until N tokens are held (mlx-lm's
``quantized_kv_start``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillama.kv.codecs import CODE_PARTS, Codec, exact_codec
from minillama.kv.ring import Cursor, Ring, RingView, ring_buffer
from minillama.kv.spec import KVSpec


@dataclass(frozen=True)
class PartView:
    """One held part of one tensor of one layer: n consecutive tokens at positions first_position..."""

    name: str  # "sinks" | "body" | "tier" | "residual"
    n: int  # tokens held in this part
    first_position: int  # position of its first token (positions are consecutive inside a part)
    codec: Codec  # how its rows are stored: the tensor's codec for the body, an exact float codec otherwise
    group: int
    rings: dict[str, RingView]  # the codec's parts by name ("values" for exact rows; "codes", "scale", ...)


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


TIER = "tier:"  # the prefix of the tier's rings in a layout (its codec's parts: "tier:codes", "tier:scale")


def layout(codec: Codec, group: int, spec: KVSpec, capacity: int, head_dim: int) -> dict[str, RingShape]:
    """The rings one tensor of one layer preallocates: sinks, residual, the tier's parts (named
    ``tier:<part>``, one row a token, room for N + unit - 1) and the body's parts.

    The body holds the rest of the capacity, in rows of ``tokens_per_row`` tokens per part."""
    exact = codec.exact_dtype
    tier, tier_codec = spec.tier_of(codec)
    shapes = {
        "sinks": RingShape(spec.sinks, head_dim, exact),
        "residual": RingShape(spec.residual if tier else residual_slots(codec, group, spec), head_dim, exact),
    }
    if tier:
        for p in tier_codec.parts(head_dim, head_dim):  # one scale (group) per token row
            shapes[TIER + p.name] = RingShape(tier + codec.unit(group) - 1, p.width, p.dtype)
    body_tokens = capacity - spec.sinks - spec.residual - tier
    for p in codec.parts(head_dim, group):
        shapes[p.name] = RingShape(body_tokens // p.tokens_per_row, p.width, p.dtype)
    return shapes


def allocation_bytes(codec: Codec, group: int, spec: KVSpec, capacity: int, head_dim: int) -> int:
    """Bytes one tensor of one layer allocates per (sequence, KV head): the closed form of
    ``TensorStore.allocated_bytes`` before any per-sequence parameter (key center, ranges) exists."""
    return sum(shape.nbytes for shape in layout(codec, group, spec, capacity, head_dim).values())


class TensorStore:
    """Sinks, quantized body, tier and residual for one tensor (K or V) of one layer."""

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
        bufs: dict[str, torch.Tensor] | None = None,
        cursors: dict[str, Cursor] | None = None,
    ):
        """`bufs`: each ring's buffer (B, H, slots, width) by name, views into buffers several layers
        share (kv/layered.py: LayeredStore), and `cursors` the rings' cursors they share; zeros of
        the layout's shapes and cursors of their own when None. The group moves the cursors
        (LayeredStore: append, truncate_nonsink, clear); a store reads them."""
        self.codec, self.group, self.head_dim = codec, group, head_dim
        self.centered = centered
        self.center: torch.Tensor | None = (
            None  # (B, H, 1, D) per-channel mean in storage space, set by the first append
        )
        self.residual_len, self.unit, self.start = spec.residual, codec.unit(group), spec.start
        shapes = layout(codec, group, spec, capacity, head_dim)
        if bufs is None:
            bufs = {
                name: ring_buffer((batch, heads, shape.slots, shape.width), shape.dtype, device)
                for name, shape in shapes.items()
            }
        rings = {name: Ring(bufs[name], (cursors or {}).get(name)) for name in shapes}  # each (B, H, slots, width)
        self.sinks = rings.pop("sinks")  # (B, H, S, D)
        self.residual = rings.pop("residual")  # (B, H, R+unit-1, D), or (B, H, R, D) with a tier
        self.tier_len, self.tier_codec = spec.tier_of(codec)
        self.tier = {name.removeprefix(TIER): rings.pop(name) for name in list(rings) if name.startswith(TIER)}
        self.body = rings  # part name -> (B, H, rows, width)
        self.tokens_per_row = {p.name: p.tokens_per_row for p in codec.parts(head_dim, group)}

    @property
    def n_body(self) -> int:
        """Tokens in the body: a part's rows times the tokens a row holds (every part's alike)."""
        name, ring = next(iter(self.body.items()))
        return ring.count * self.tokens_per_row[name]

    @property
    def held(self) -> int:
        return self.sinks.count + self.n_body + self.n_tier + self.residual.count

    @property
    def n_tier(self) -> int:
        """Tokens in the tier (one row each)."""
        return self.tier["codes"].count if self.tier else 0

    @property
    def center_bytes(self) -> int:
        """Bytes of the key center (center=1), once it is set."""
        return 0 if self.center is None else self.center.numel() * self.center.element_size()

    def live_read_bytes(self) -> int:
        """Bytes a full read of the held tokens touches (sinks, body and tier parts, residual, key center)."""
        return (
            self.sinks.live_bytes
            + sum(r.live_bytes for r in [*self.body.values(), *self.tier.values()])
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
            pieces.append(parts["values"] if "values" in parts else self.codec.decode(parts, self.group, self.head_dim))
        if self.n_tier:
            parts = {name: ring.read() for name, ring in self.tier.items()}
            pieces.append(self.tier_codec.decode(parts, self.head_dim, self.head_dim))  # one scale a row
        if self.residual.count:
            pieces.append(self.residual.read())
        nbytes = self.live_read_bytes()
        if len(pieces) == 1:
            return pieces[0].to(dtype), nbytes
        if not pieces:
            return self.sinks.buf[:, :, :0].to(dtype), 0
        return torch.cat([p.to(dtype) for p in pieces], dim=2), nbytes

    def parts(self, first_rest: int) -> list[PartView]:
        """The held parts in age order (sinks, body, tier, residual), each with the position of its
        first token: sinks from 0, the rest consecutive from `first_rest` (the cache knows it)."""
        positions = (0, first_rest, first_rest + self.n_body, first_rest + self.n_body + self.n_tier)
        exact = exact_codec(self.residual.buf.dtype)
        held = [
            ("sinks", self.sinks.count, exact, self.group, {"values": self.sinks.view()}),
            ("body", self.n_body, self.codec, self.group, {k: r.view() for k, r in self.body.items()}),
            ("tier", self.n_tier, self.tier_codec, self.head_dim, {k: r.view() for k, r in self.tier.items()}),
            ("residual", self.residual.count, exact, self.group, {"values": self.residual.view()}),
        ]
        return [
            PartView(name, n, first, codec, group, rings)
            for (name, n, codec, group, rings), first in zip(held, positions)
            if n
        ]

    def keep_newest_limit(self, n_nonsink: int) -> int:
        """Largest m <= n_nonsink such that the oldest m non-sink tokens can be kept exactly."""
        if n_nonsink >= self.n_body:
            return n_nonsink
        return n_nonsink // self.unit * self.unit  # a per-channel group cannot be cut

    def live_bytes(self) -> dict[str, int]:
        """Held bytes by component: codes and scales of the body and the tier, residual, sinks."""
        coded = [*self.body.items(), *self.tier.items()]
        codes = sum(r.live_bytes for n, r in coded if n in CODE_PARTS)
        scales = sum(r.live_bytes for n, r in coded if n not in CODE_PARTS) + self.center_bytes
        return {"codes": codes, "scales": scales, "residual": self.residual.live_bytes, "sinks": self.sinks.live_bytes}

    def allocated_bytes(self) -> int:
        rings = [self.sinks, self.residual, *self.body.values(), *self.tier.values()]
        return sum(r.allocated_bytes for r in rings) + self.center_bytes
