"""The cache write: one tensor (K or V) of every layer that shares a codec, written at once.

All layers of a cache hold the same tokens, so they fill their sinks, evict and flush the same
tokens in the same step. The stores of the layers that share a codec therefore keep their
rings in one buffer with a layer axis, (L, B, H, slots, width), each layer's ring a view of
its slice; an append moves the new vectors of every layer of the group with one tensor
operation per ring and encodes one block for all of them (one rotation, one ``encode`` call),
then moves the rings' shared cursors once: a handful of PyTorch calls per group, whatever
the layer count, where a layer-by-layer write paid ~30 per layer. The arithmetic of a write
(rotation, centering, codes) is its ``Writer``'s (kv/write.py). The bytes are the ones a
layer-by-layer write leaves (tests/test_cache.py holds them equal): codecs work per row and per
group of tokens, never across layers.

The members' rings share one cursor each (kv/ring.py: Cursor), so they hold alike by
construction: an append, an eviction, ``truncate_nonsink`` and ``clear`` move it once, here,
for every layer (a cache file's restore sets it, kv/file.py).
"""

from __future__ import annotations

import torch

from minillama.kv.ring import Cursor, Ring, ring_buffer
from minillama.kv.store import TIER, TensorStore, layout
from minillama.kv.write import REFERENCE, Writer


class SharedRing:
    """The same ring of every layer of a group: the members' buffers are slices of `buf`."""

    def __init__(self, buf: torch.Tensor, members: list[Ring]):
        self.buf = buf  # (L, B, H, slots, width)
        self.members = members
        self.lead = members[0]  # a member, whose cursor every member shares
        assert all(m.cursor is self.lead.cursor for m in members)

    def push(self, x: torch.Tensor) -> int:
        """Append rows x (L, B, H, n, width) after the newest of every layer; returns bytes written."""
        n = x.shape[3]
        if self.lead.count + n > self.lead.slots:
            raise RuntimeError(f"ring overflow: {self.lead.count} + {n} rows > {self.lead.slots} slots")
        done = 0
        for a, b in self.lead.spans(self.lead.count, n):
            self.buf[:, :, :, a:b] = x[:, :, :, done : done + b - a]
            done += b - a
        return self.advance(n)

    def read(self, first: int, n: int) -> torch.Tensor:
        """Rows [first, first + n) of every layer in age order, (L, B, H, n, width)."""
        spans = self.lead.spans(first, n)
        if len(spans) == 1:
            a, b = spans[0]
            return self.buf[:, :, :, a:b]
        if not spans:
            return self.buf[:, :, :, :0]
        return torch.cat([self.buf[:, :, :, a:b] for a, b in spans], dim=3)

    def advance(self, n: int) -> int:
        """n rows were written after the newest of every layer (by a kernel): count them; bytes written."""
        self.lead.count += n
        return n * self.lead.row_bytes * len(self.members)

    def drop_oldest(self, n: int) -> None:
        self.lead.drop_oldest(n)

    def drop_newest(self, n: int) -> None:
        self.lead.drop_newest(n)

    def clear(self) -> None:
        self.lead.clear()


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
        cursors = {name: Cursor() for name in bufs}  # every layer's ring of a name shares one
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
                cursors,
            )
            for i in range(n)
        ]
        self.sinks = SharedRing(bufs.pop("sinks"), [s.sinks for s in self.stores])
        self.residual = SharedRing(bufs.pop("residual"), [s.residual for s in self.stores])
        self.tier = {  # the tier's parts (kv/store.py), by the tier codec's part names
            name.removeprefix(TIER): SharedRing(bufs.pop(name), [s.tier[name.removeprefix(TIER)] for s in self.stores])
            for name in list(bufs)
            if name.startswith(TIER)
        }
        self.body = {name: SharedRing(buf, [s.body[name] for s in self.stores]) for name, buf in bufs.items()}

    def append(self, x: torch.Tensor, evict: int, writer: Writer = REFERENCE) -> tuple[int, int]:
        """Store new vectors x (L, B, H, n, D) in the model's dtype, after evicting `evict` oldest non-sink
        tokens of every layer, converted and coded by `writer`; returns (bytes written, bytes read).

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
        x = writer.storage_form(codec, x, center, exact)  # (L, B, H, n, D)
        written = read = 0
        take = min(lead.sinks.slots - lead.sinks.count, x.shape[3])
        if take:
            written += self.sinks.push(x[:, :, :, :take])
            x = x[:, :, :, take:]
        if evict:
            from_body = min(evict, lead.n_body)
            self._drop_body(from_body)
            from_tier = min(evict - from_body, lead.n_tier)
            self._drop_tier(from_tier)
            from_res = min(evict - from_body - from_tier, lead.residual.count)
            self.residual.drop_oldest(from_res)
            x = x[:, :, :, evict - from_body - from_tier - from_res :]
        if self.tier:
            w, r = self._through_tier(x, writer)
            return written + w, read + r
        n_flush = self.flush_count(lead.residual.count + x.shape[3])
        if n_flush:
            r = min(n_flush, lead.residual.count)
            old = self.residual.read(0, r)  # (L, B, H, r, D)
            read += r * lead.residual.row_bytes * len(stores)
            n_new = n_flush - r
            block = torch.cat([old, x[:, :, :, :n_new]], dim=3) if r else x[:, :, :, :n_new]  # (L, B, H, n_flush, D)
            written += self._encode(block, n_flush, writer)
            if r:
                self.residual.drop_oldest(r)
            x = x[:, :, :, n_new:]
        if x.shape[3]:
            written += self.residual.push(x)
        return written, read

    def _through_tier(self, x: torch.Tensor, writer: Writer) -> tuple[int, int]:
        """``append``'s flush with a tier (kv/store.py): new non-sink vectors x (L, B, H, n, D) in
        storage form. The tokens leaving the exact residual (its oldest, then the oldest new ones)
        go to the tier; once ``tier + unit`` wait there, whole units of its oldest go to the body,
        decoded from the tier and coded again; leaving tokens the body takes in the same append
        are coded once, from their exact values. Returns (bytes written, bytes read)."""
        lead = self.stores[0]
        res, n_layers = lead.residual, len(self.stores)
        leave = max(0, res.count + x.shape[3] - lead.residual_len)  # tokens leaving the residual
        n_flush = self.tier_flush_count(leave)  # tokens into the body
        from_tier = min(n_flush, lead.n_tier)
        from_res = min(leave, res.count)
        old, new = self.residual.read(0, from_res), x[:, :, :, : leave - from_res]
        leaving = torch.cat([old, new], dim=3)  # (L, B, H, leave, D): the oldest exact tokens
        written, read = 0, from_res * res.row_bytes * n_layers
        if n_flush:
            block = leaving[:, :, :, : n_flush - from_tier]  # (L, B, H, n, D): exact, straight to the body
            if from_tier:
                block = torch.cat([self._decode_tier(from_tier).to(block.dtype), block], dim=3)
                read += self._drop_tier(from_tier)
            written += self._encode(block, n_flush, writer)
        to_tier = leaving[:, :, :, n_flush - from_tier :]  # (L, B, H, m, D)
        if to_tier.shape[3]:
            l_, b, h, m, d = to_tier.shape
            parts = writer.encode(lead.tier_codec, to_tier.reshape(l_ * b, h, m, d), d)  # (L*B, H, m, width) each
            for name, part in parts.items():
                written += self.tier[name].push(part.reshape(l_, b, *part.shape[1:]))
        self.residual.drop_oldest(from_res)
        stay = x[:, :, :, leave - from_res :]
        if stay.shape[3]:
            written += self.residual.push(stay)
        return written, read

    def tier_flush_count(self, leave: int) -> int:
        """With a tier: tokens to move from the tier into the body now, as `leave` tokens leave the
        exact residual -- whole units once ``tier + unit`` would wait there."""
        lead = self.stores[0]
        return max(0, (lead.n_tier + leave - lead.tier_len) // lead.unit * lead.unit)

    def _drop_body(self, n: int, newest: bool = False) -> None:
        """Drop the n oldest (or newest) body tokens of every layer."""
        lead = self.stores[0]
        for name, ring in self.body.items():
            rows = n // lead.tokens_per_row[name]
            ring.drop_newest(rows) if newest else ring.drop_oldest(rows)

    def truncate_nonsink(self, m: int) -> None:
        """Keep only the oldest m non-sink tokens of every layer (m from ``keep_newest_limit``): the
        newest go first, from the residual, then the tier, then the body."""
        lead = self.stores[0]
        drop = lead.n_body + lead.n_tier + lead.residual.count - m
        from_res = min(drop, lead.residual.count)
        self.residual.drop_newest(from_res)
        from_tier = min(drop - from_res, lead.n_tier)
        for ring in self.tier.values():
            ring.drop_newest(from_tier)
        self._drop_body(drop - from_res - from_tier, newest=True)

    def clear(self) -> None:
        """Forget every token and each layer's per-sequence parameters (key center, ranges)."""
        for ring in [self.sinks, self.residual, *self.body.values(), *self.tier.values()]:
            ring.clear()
        for store in self.stores:
            store.center = None

    def _drop_tier(self, n: int) -> int:
        """Drop the n oldest tier tokens of every layer; returns their bytes (read, when they move on)."""
        for ring in self.tier.values():
            ring.drop_oldest(n)
        return sum(ring.lead.row_bytes * n * len(self.stores) for ring in self.tier.values())

    def _decode_tier(self, n: int) -> torch.Tensor:
        """The oldest n tier tokens of every layer, decoded: (L, B, H, n, D) float32, storage space."""
        lead = self.stores[0]
        parts = {name: ring.read(0, n) for name, ring in self.tier.items()}  # (L, B, H, n, width) each
        l_, b, h = next(iter(parts.values())).shape[:3]
        flat = {name: p.reshape(l_ * b, h, *p.shape[3:]) for name, p in parts.items()}
        return lead.tier_codec.decode(flat, lead.head_dim, lead.head_dim).reshape(l_, b, h, n, lead.head_dim)

    def flush_count(self, waiting: int) -> int:
        """Tokens to encode into the body now, with `waiting` non-sink tokens past the body (the
        residual and the new ones): whole units once ``residual + unit`` wait, and only once
        ``start`` tokens are held."""
        lead = self.stores[0]
        if lead.sinks.count + lead.n_body + waiting < lead.start:
            return 0
        return max(0, (waiting - lead.residual_len) // lead.unit * lead.unit)

    def _encode(self, block: torch.Tensor, n_flush: int, writer: Writer) -> int:
        """Encode block (L, B, H, n_flush, D) into the body. Returns bytes written."""
        lead = self.stores[0]
        n_layers, b, h, _, d = block.shape
        parts = writer.encode(
            lead.codec, block.reshape(n_layers * b, h, n_flush, d), lead.group
        )  # (L*B, H, rows, width)
        written = 0
        for name, part in parts.items():
            written += self.body[name].push(part.reshape(n_layers, b, *part.shape[1:]))  # (L, B, H, rows, width)
        return written
