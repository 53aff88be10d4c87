"""The cache write: one tensor (K or V) of every layer that shares a codec, written at once.

All layers of a cache hold the same tokens, so they fill their sinks, evict and flush the same
tokens in the same step. The stores of the layers that share a codec therefore keep their
rings in one buffer with a layer axis, (L, B, H, slots, width), each layer's ring a view of
its slice; an append moves the new vectors of every layer of the group with one tensor
operation per ring and encodes one block for all of them (one rotation, one ``encode`` call),
then advances every member's counters alike: a handful of PyTorch calls per group, whatever
the layer count, where a layer-by-layer write paid ~30 per layer. A decode token goes faster
still: ``token_write`` describes the group's share of it from the counters alone, and the cache
(cache.py: ``_append_token``) writes every group's share with one native call, all or nothing.
The bytes are the ones a layer-by-layer write leaves (tests/test_cache.py holds them equal):
codecs work per row and per group of tokens, never across layers.

The members' counters are kept equal by construction: every change to them (an append here;
``truncate``, ``clear`` and a cache file's restore in the cache) is applied to every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minillama.kv.codecs import Affine, Codebook, FloatCodec
from minillama.kv.freq_blocks import FrequencyBlocks, block_books, block_widths
from minillama.kv.quantize import REFINE, gaussian_codebook
from minillama.kv.ring import Ring, ring_buffer
from minillama.kv.store import TIER, TensorStore, layout
from minillama.kv.write import encode, native_encoding, storage_form
from minillama.native.abi import DTYPE_CODE, RingRef, TokenWrite


class SharedRing:
    """The same ring of every layer of a group: the members' buffers are slices of `buf`."""

    def __init__(self, buf: torch.Tensor, members: list[Ring]):
        self.buf = buf  # (L, B, H, slots, width)
        self.members = members
        self.lead = members[0]  # every member has its counters
        # As write_tokens addresses it: (L * B * H) rows of slots x width bytes (the buffer never moves).
        self.ref = RingRef(buf.data_ptr(), buf.shape[3], buf.shape[4] * buf.element_size())

    def push(self, x: torch.Tensor) -> int:
        """Append rows x (L, B, H, n, width) after the newest of every layer; returns bytes written."""
        n = x.shape[3]
        if self.lead.count + n > self.lead.slots:
            raise RuntimeError(f"ring overflow: {self.lead.count} + {n} rows > {self.lead.slots} slots")
        done = 0
        for a, b in self.lead._spans(self.lead.count, n):
            self.buf[:, :, :, a:b] = x[:, :, :, done : done + b - a]
            done += b - a
        return self.advance(n)

    def read(self, first: int, n: int) -> torch.Tensor:
        """Rows [first, first + n) of every layer in age order, (L, B, H, n, width)."""
        spans = self.lead._spans(first, n)
        if len(spans) == 1:
            a, b = spans[0]
            return self.buf[:, :, :, a:b]
        if not spans:
            return self.buf[:, :, :, :0]
        return torch.cat([self.buf[:, :, :, a:b] for a, b in spans], dim=3)

    def advance(self, n: int) -> int:
        """n rows were written after the newest of every layer (by a kernel): count them; bytes written."""
        for ring in self.members:
            ring.count += n
        return n * self.lead.row_bytes * len(self.members)

    def drop_oldest(self, n: int) -> None:
        if n:  # most decode tokens drop nothing: no pass over every layer's ring for it
            for ring in self.members:
                ring.drop_oldest(n)


class LayeredStore:
    """One tensor (K or V) of the layers that share a codec, group size and centering: a
    ``TensorStore`` per layer (what a reader of one layer sees), their rings in shared buffers."""

    def __init__(
        self,
        layers: list[int],
        codec,
        group: int,
        spec,
        capacity: int,
        batch: int,
        heads: int,
        head_dim: int,
        device,
        centered: bool,
    ):
        self.layers = layers  # the cache's index of each member layer, in order
        self.layer_index = torch.tensor(layers, device=device)  # (L,) the same, to pick a step's rows
        n = len(layers)
        bufs = {
            name: ring_buffer((n, batch, heads, shape.slots, shape.width), shape.dtype, device)
            for name, shape in layout(codec, group, spec, capacity, head_dim).items()
        }  # name -> (L, B, H, slots, width)
        self.stores = [
            TensorStore(
                codec,
                group,
                spec,
                capacity,
                batch,
                heads,
                head_dim,
                device,
                centered,
                {k: b[i] for k, b in bufs.items()},
            )
            for i in range(n)
        ]
        self.sinks = SharedRing(bufs.pop("sinks"), [s.sinks for s in self.stores])
        self.residual = SharedRing(bufs.pop("residual"), [s.residual for s in self.stores])
        self.tier = {  # the tier's parts (kv/store.py), by the tier codec's part names
            name[len(TIER) :]: SharedRing(bufs.pop(name), [s.tier[name[len(TIER) :]] for s in self.stores])
            for name in list(bufs)
            if name.startswith(TIER)
        }
        self.body = {name: SharedRing(buf, [s.body[name] for s in self.stores]) for name, buf in bufs.items()}
        self._centers: tuple[list, torch.Tensor] | None = None  # centered keys: the members' centers, stacked

    def append(self, x: torch.Tensor, evict: int) -> tuple[int, int]:
        """Store new vectors x (L, B, H, n, D) in the model's dtype, after evicting `evict` oldest non-sink
        tokens of every layer; returns (bytes written, bytes read).

        In order: the first tokens fill the sinks; the oldest are evicted from the body, then the
        residual, then the new ones; once ``residual + unit`` tokens wait (and ``start`` tokens are
        held) whole units of the oldest are encoded into the body; the rest wait in the residual."""
        lead, stores = self.stores[0], self.stores
        codec = lead.codec
        exact = lead.residual.buf.dtype
        if lead.centered and lead.center is None:  # the first append sets each layer's center
            means = codec.to_space(x).float().mean(dim=-2, keepdim=True).to(exact)  # (L, B, H, 1, D)
            for store, m in zip(stores, means):
                store.center = m
        center = torch.stack([s.center for s in stores]) if lead.centered else None  # (L, B, H, 1, D)
        # Everything enters in the exact dtype (fp16 for quantized codecs), so a token is
        # quantized from the same values whether or not it waited in the residual.
        x = storage_form(codec, x, center, exact)  # (L, B, H, n, D)
        written = read = 0
        take = min(lead.sinks.slots - lead.sinks.count, x.shape[3])
        if take:
            written += self.sinks.push(x[:, :, :, :take])
            x = x[:, :, :, take:]
        if evict:
            from_body = min(evict, lead.n_body)
            for store in stores:
                store._drop_body(from_body)
            from_tier = min(evict - from_body, lead.n_tier)
            for ring in self.tier.values():
                ring.drop_oldest(from_tier)
            from_res = min(evict - from_body - from_tier, lead.residual.count)
            self.residual.drop_oldest(from_res)
            x = x[:, :, :, evict - from_body - from_tier - from_res :]
        if self.tier:
            w, r = self._through_tier(x)
            return written + w, read + r
        n_flush = self._flush_count(lead.residual.count + x.shape[3])
        if n_flush:
            r = min(n_flush, lead.residual.count)
            old = self.residual.read(0, r)  # (L, B, H, r, D)
            read += r * lead.residual.row_bytes * len(stores)
            n_new = n_flush - r
            block = torch.cat([old, x[:, :, :, :n_new]], dim=3) if r else x[:, :, :, :n_new]  # (L, B, H, n_flush, D)
            written += self._encode(block, x[:, :, :, n_new:], n_flush)
            if r:
                self.residual.drop_oldest(r)
            x = x[:, :, :, n_new:]
        if x.shape[3]:
            written += self.residual.push(x)
        return written, read

    def _through_tier(self, x: torch.Tensor) -> tuple[int, int]:
        """``append``'s flush with a tier (kv/store.py): new non-sink vectors x (L, B, H, n, D) in
        storage form. The tokens leaving the exact residual (its oldest, then the oldest new ones)
        go to the tier; once ``tier + unit`` wait there, whole units of its oldest go to the body,
        decoded from the tier and coded again; leaving tokens the body takes in the same append
        are coded once, from their exact values. Returns (bytes written, bytes read)."""
        lead = self.stores[0]
        res, n_layers, unit = lead.residual, len(self.stores), lead.unit
        leave = max(0, res.count + x.shape[3] - lead.residual_len)  # tokens leaving the residual
        n_flush = max(0, (lead.n_tier + leave - lead.tier_len) // unit * unit)  # tokens into the body
        from_tier = min(n_flush, lead.n_tier)
        from_res = min(leave, res.count)
        old, new = self.residual.read(0, from_res), x[:, :, :, : leave - from_res]
        leaving = torch.cat([old, new], dim=3)  # (L, B, H, leave, D): the oldest exact tokens
        written, read = 0, from_res * res.row_bytes * n_layers
        if n_flush:
            block = leaving[:, :, :, : n_flush - from_tier]  # (L, B, H, n, D): exact, straight to the body
            if from_tier:
                block = torch.cat([self._decode_tier(from_tier).to(block.dtype), block], dim=3)
                read += sum(ring.lead.row_bytes * from_tier * n_layers for ring in self.tier.values())
                for ring in self.tier.values():
                    ring.drop_oldest(from_tier)
            written += self._encode(block, block[:, :, :, :0], n_flush)
        to_tier = leaving[:, :, :, n_flush - from_tier :]  # (L, B, H, m, D)
        if to_tier.shape[3]:
            l_, b, h, m, d = to_tier.shape
            parts = encode(lead.tier_codec, to_tier.reshape(l_ * b, h, m, d), d)  # (L*B, H, m, width) each
            for name, part in parts.items():
                written += self.tier[name].push(part.reshape(l_, b, *part.shape[1:]))
        self.residual.drop_oldest(from_res)
        stay = x[:, :, :, leave - from_res :]
        if stay.shape[3]:
            written += self.residual.push(stay)
        return written, read

    def _decode_tier(self, n: int) -> torch.Tensor:
        """The oldest n tier tokens of every layer, decoded: (L, B, H, n, D) float32, storage space."""
        lead = self.stores[0]
        parts = {name: ring.read(0, n) for name, ring in self.tier.items()}  # (L, B, H, n, width) each
        l_, b, h = next(iter(parts.values())).shape[:3]
        flat = {name: p.reshape(l_ * b, h, *p.shape[3:]) for name, p in parts.items()}
        return lead.tier_codec.decode(flat, lead.head_dim, lead.head_dim).reshape(l_, b, h, n, lead.head_dim)

    def _flush_count(self, waiting: int) -> int:
        """Tokens to encode into the body now, with `waiting` non-sink tokens past the body (the
        residual and the new ones): whole units once ``residual + unit`` wait, and only once
        ``start`` tokens are held."""
        lead = self.stores[0]
        if lead.sinks.count + lead.n_body + waiting < lead.start:
            return 0
        return max(0, (waiting - lead.residual_len) // lead.unit * lead.unit)

    def _encode(self, block: torch.Tensor, rest: torch.Tensor, n_flush: int) -> int:
        """Encode block (L, B, H, n_flush, D) into the body; the first flush of a calibrated codec
        fits its per-sequence ranges on every held non-sink token (the block and the `rest` that
        stays in the residual). Returns bytes written."""
        lead, stores = self.stores[0], self.stores
        codec = lead.codec
        n_layers, b, h, _, d = block.shape
        if codec.per_sequence and lead.params is None:
            held = torch.cat([block, rest], dim=3)  # (L, B, H, n, D)
            params = codec.calibrate(held.reshape(n_layers * b, h, *held.shape[3:]))  # each (L*B, H, ...)
            for i, store in enumerate(stores):
                store.params = {name: p.reshape(n_layers, b, *p.shape[1:])[i] for name, p in params.items()}
        params = None
        if codec.per_sequence:
            params = {
                name: torch.stack([s.params[name] for s in stores]).reshape(n_layers * b, *lead.params[name].shape[1:])
                for name in lead.params
            }
        parts = encode(codec, block.reshape(n_layers * b, h, n_flush, d), lead.group, params)  # (L*B, H, rows, width)
        written = 0
        for name, part in parts.items():
            written += self.body[name].push(part.reshape(n_layers, b, *part.shape[1:]))  # (L, B, H, rows, width)
        for store in stores:
            store.n_body += n_flush
        return written

    def token_write(self, x: torch.Tensor) -> PendingWrite | None:
        """This group's share of one decode token (nothing to evict) as native/encode.cpp's
        write_tokens takes it: the same decisions as ``append``, taken here from the counters, and
        the same bytes (a test holds them equal). Nothing changes until the cache has made the
        write and called ``finish``. None where the kernel does not write this codec (vector codes,
        calibrated ranges, non-float16 rows, the first append of centered keys, a tier whose codec
        is not a codebook): ``append`` then does it."""
        lead = self.stores[0]
        codec = lead.codec
        kind = _token_kind(codec)
        if kind is None or x.dtype not in DTYPE_CODE or lead.residual.buf.dtype != torch.float16:
            return None
        if self.tier:
            return self._tier_token_write(x, kind)
        if lead.centered and lead.center is None:
            return None
        if isinstance(codec, FrequencyBlocks) and len(codec.widths) != x.shape[2]:
            return None  # a widths table for another head count: ``append`` says so
        sinks, res = lead.sinks, lead.residual
        to_sinks = sinks.count < sinks.slots
        n_flush = self._flush_count(res.count + (0 if to_sinks else 1))
        r = min(n_flush, res.count)
        encoded = n_flush - r  # 1: the new token is the block's last row
        x = x.contiguous()  # (L, B, H, 1, D)
        center = self._center16() if lead.centered else None  # (L, B, H, 1, D) float16
        w = self._write(x, center)
        to = self.sinks if to_sinks else None if encoded else self.residual
        if to is not None:
            w.to, w.to_slot = to.ref, (to.lead.start + to.lead.count) % to.lead.slots
        if n_flush:
            w.flush, w.from_res, w.res, w.res_first = n_flush, r, self.residual.ref, res.start
            self._into_body(w, kind)
        widths = None
        if isinstance(codec, FrequencyBlocks):  # each head's blocks at their own widths, one-byte scales
            widths = block_widths(codec.widths)  # (H, nb)
            w.blocks, w.widths, w.heads = codec.blocks, widths.data_ptr(), widths.shape[0]
        return PendingWrite([w], [x, center, kind[2], widths], lambda: self._after_token(n_flush, r, to))

    def _write(self, x: torch.Tensor, center: torch.Tensor | None) -> TokenWrite:
        """A TokenWrite of x (L, B, H, 1, D) that stores nothing yet (the fields say where)."""
        codec = self.stores[0].codec
        w = TokenWrite(L=x.shape[0], BH=x.shape[1] * x.shape[2], D=x.shape[-1], dtype=DTYPE_CODE[x.dtype])
        w.x, w.rotate, w.center = x.data_ptr(), codec.rotation, center.data_ptr() if center is not None else None
        return w

    def _into_body(self, w: TokenWrite, kind) -> None:
        """Point w's encoded block at the next rows of the body (kind: ``_token_kind`` of its codec)."""
        bits, axis, levels = kind
        lead = self.stores[0]
        w.bits, w.group, w.axis = bits, lead.group, axis
        data = self.body["values" if bits == 0 else "codes"]
        w.codes, w.codes_slot = data.ref, data.lead.start + data.lead.count
        if bits:
            w.scale = self.body["scale"].ref
            w.scale_slot = self.body["scale"].lead.start + self.body["scale"].lead.count
            if levels is None:
                w.zero = self.body["zero"].ref
            else:  # a codebook: codes and scales, no zeros
                w.levels, w.refine, w.log_scale = levels.data_ptr(), REFINE, int(lead.codec.log_scale)

    def _into_tier(self, w: TokenWrite, levels: torch.Tensor) -> None:
        """Point w's encoded block at the tier's next row (a codebook: codes, one scale a row of D)."""
        tier, codes, scale = self.stores[0].tier_codec, self.tier["codes"], self.tier["scale"]
        w.bits, w.group, w.axis = tier.bits, w.D, 0
        w.codes, w.codes_slot = codes.ref, codes.lead.start + codes.lead.count
        w.scale, w.scale_slot = scale.ref, scale.lead.start + scale.lead.count
        w.levels, w.refine, w.log_scale = levels.data_ptr(), REFINE, int(tier.log_scale)

    def _tier_token_write(self, x: torch.Tensor, kind) -> PendingWrite | None:
        """``token_write`` with a tier (``_through_tier``'s decisions for one token): at most two
        writes, in this order -- the tier's oldest whole unit decoded and coded into the body (when
        ``tier + unit`` would wait), then the residual's oldest row coded into the tier and the new
        token into its slot. None where the tier's codec is not a codebook (``append`` does it)."""
        lead = self.stores[0]
        tier_kind = _token_kind(lead.tier_codec)
        if tier_kind is None or tier_kind[2] is None or isinstance(lead.codec, FrequencyBlocks):
            return None  # an affine tier, or frequency-block keys beside one: the PyTorch path
        if lead.centered and lead.center is None:
            return None
        x = x.contiguous()  # (L, B, H, 1, D)
        center = self._center16() if lead.centered else None  # (L, B, H, 1, D) float16
        sinks, res = lead.sinks, lead.residual
        to_sinks = sinks.count < sinks.slots
        leave = 0 if to_sinks else max(0, res.count + 1 - lead.residual_len)  # 0 or 1 row leaves the residual
        n_flush = max(0, (lead.n_tier + leave - lead.tier_len) // lead.unit * lead.unit) if leave else 0
        writes = []
        if n_flush:  # the tier's oldest unit, decoded, into the body
            w = self._write(x, center)
            w.flush, w.from_res, w.res_first = n_flush, n_flush, self.tier["codes"].lead.start
            w.res = self.tier["codes"].ref  # (the rows come from src_codes)
            self._into_body(w, kind)
            w.src_codes, w.src_scale = self.tier["codes"].ref, self.tier["scale"].ref
            w.src_levels, w.src_bits = tier_kind[2].data_ptr(), lead.tier_codec.bits
            w.src_log_scale = int(lead.tier_codec.log_scale)
            writes.append(w)
        w = self._write(x, center)
        r = min(leave, res.count)  # 0 with residual=0: the new token itself goes to the tier
        if leave:  # the residual's oldest row (or the new token) into the tier
            w.flush, w.from_res, w.res, w.res_first = 1, r, self.residual.ref, res.start
            self._into_tier(w, tier_kind[2])
        to = self.sinks if to_sinks else None if leave and not r else self.residual
        if to is not None:  # the new token into its slot (after the row that leaves is read)
            w.to, w.to_slot = to.ref, (to.lead.start + to.lead.count) % to.lead.slots
        writes.append(w)
        keep = [x, center, kind[2], tier_kind[2]]
        return PendingWrite(writes, keep, lambda: self._after_tier_token(n_flush, leave, r, to))

    def _after_tier_token(self, n_flush: int, leave: int, r: int, to: SharedRing | None) -> tuple[int, int]:
        """Move the counters as ``_through_tier`` moves them for one token; (bytes written, bytes read)."""
        lead, n_layers = self.stores[0], len(self.stores)
        written = read = 0
        if n_flush:
            for name, ring in self.body.items():
                written += ring.advance(n_flush // lead.tokens_per_row[name])
            read += sum(ring.lead.row_bytes * n_flush * n_layers for ring in self.tier.values())
            for ring in self.tier.values():
                ring.drop_oldest(n_flush)
            for store in self.stores:
                store.n_body += n_flush
        if leave:
            read += r * lead.residual.row_bytes * n_layers
            self.residual.drop_oldest(r)
            for ring in self.tier.values():
                written += ring.advance(1)
        return written + (to.advance(1) if to is not None else 0), read

    def _after_token(self, n_flush: int, r: int, to: SharedRing | None) -> tuple[int, int]:
        """Move the counters as ``append``'s pushes and drops move them; (bytes written, bytes read)."""
        lead = self.stores[0]
        written = read = 0
        if n_flush:
            for name, ring in self.body.items():
                written += ring.advance(n_flush // lead.tokens_per_row[name])
            read += r * lead.residual.row_bytes * len(self.stores)
            self.residual.drop_oldest(r)
            for store in self.stores:
                store.n_body += n_flush
        if to is not None:
            written += to.advance(1)
        return written, read

    def _center16(self) -> torch.Tensor:
        """Every member's key center stacked, (L, B, H, 1, D) float16; made again only when a center changes."""
        centers = [s.center for s in self.stores]  # held below, so an old center's id is never reused
        if self._centers is None or any(a is not b for a, b in zip(centers, self._centers[0])):
            self._centers = (centers, torch.stack(centers).to(torch.float16).contiguous())
        return self._centers[1]


@dataclass
class PendingWrite:
    """A group's share of a decode token's write (native/encode.cpp: write_tokens, made in order),
    what it points into, and what counts it once the cache has made it (bytes written, bytes read)."""

    writes: list[TokenWrite]
    keep: list
    finish: Callable[[], tuple[int, int]]


def _token_kind(codec) -> tuple[int, int, torch.Tensor | None] | None:
    """(bits, axis, levels) for write_tokens: bits 0 for float16 rows, else affine codes and their
    group axis, a Lloyd-Max codebook's codes (per token) and its levels, or frequency-block keys'
    average width and the books of every width; None for codecs it does not write."""
    if isinstance(codec, FloatCodec):
        return (0, 0, None) if codec.dtype == torch.float16 else None
    family = native_encoding(codec)
    if family is Affine and not codec.per_sequence and codec.bits in (2, 3, 4, 8):
        return codec.bits, int(codec.axis == "channel"), None
    if family is Codebook and codec.bits in (2, 3, 4):
        return codec.bits, 0, gaussian_codebook(codec.bits)
    if family is FrequencyBlocks:  # the books of every width end to end, as the attention kernel reads them
        return codec.bits, 0, block_books()
    return None
