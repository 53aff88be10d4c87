"""A decode token's cache write as native/encode.cpp's ``write_tokens`` takes it.

``LayeredStore.append`` (kv/layered.py) is the cache write, in PyTorch; for a decode step's
single token this module takes the same decisions from the ring counters alone and describes
them as ``TokenWrite`` structs (native/minillama.h), one or two per group of layers: where the
new row goes (sinks or residual), which rows leave the residual (or, with a tier, the tier) and
into which slots of the body their codes go. The native step makes every group's writes in one
call, all or nothing (``CacheWrites``), then each ``GroupWrites.commit`` moves the counters as
``append`` would have. tests/test_cache.py holds the bytes to ``append``'s, token by token.
"""

from __future__ import annotations

import torch

from minillama.kv.cache import KVCache
from minillama.kv.codecs import Affine, Codebook, FloatCodec, VectorCodebook
from minillama.kv.freq_blocks import FrequencyBlocks, block_books, block_widths
from minillama.kv.layered import LayeredStore, SharedRing
from minillama.kv.quantize import REFINE, gaussian_codebook, vector_patterns
from minillama.native import backend, ops
from minillama.native.abi import DTYPE_CODE, NotSupported, RingRef, TokenWrite
from minillama.native.write import native_encoding


def ring_ref(ring: SharedRing) -> RingRef:
    """A group's ring as write_tokens addresses it: (L * B * H) rows of slots x width bytes (the
    buffer never moves)."""
    buf = ring.buf  # (L, B, H, slots, width)
    return RingRef(buf.data_ptr(), buf.shape[3], buf.shape[4] * buf.element_size())


class CacheWrites:
    """A ``KVCache``'s decode-token writes: each group's ``GroupWrites`` (described on its first
    decode token) and every group's structs end to end in one array."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.groups = [GroupWrites(shared) for shared in cache.stores]
        self.writes: TokenWrites | None = None

    def describe(self, k: torch.Tensor, v: torch.Tensor) -> TokenWrites | None:
        """A decode token's write into every group, described from the counters alone: k, v
        (L, B, H_kv, 1, D) may be filled after (the native step describes its own output buffers
        before it runs, and makes the write last). Nothing changes until ``commit``. None where
        this token cannot take it (the cache is full, a group's codec is one the kernel does not
        write, the first append of centered keys): ``append_stacked`` then writes it."""
        cache = self.cache
        if cache.held + 1 > cache.capacity:
            return None
        k, v = k.contiguous(), v.contiguous()  # (L, B, H_kv, 1, D)
        groups = []
        for g, t in zip(self.groups, cache.tensor_of):
            if not token_write(g, v if t else k):  # every layer's rows: the write picks its group's
                return None
            groups.append(g)
        if self.writes is None:  # the groups' structs, placed in one array once
            self.writes = TokenWrites(groups)
        return self.writes

    def commit(self, writes: TokenWrites) -> None:
        """The native write of ``describe`` was made: move every group's counters, count it."""
        self.cache.count_append(1, 0, *writes.finish())

    def append(self, lib, k: torch.Tensor, v: torch.Tensor) -> bool:
        """A decode token into every group with one native call (all or nothing); False, with
        nothing changed, where ``describe`` declines or the kernel refuses the values."""
        writes = self.describe(k, v)
        if writes is None:
            return False
        try:
            ops.write_tokens(lib, writes.array)
        except NotSupported:
            return False
        self.commit(writes)
        backend.ran("token write")
        return True


def token_write(g: GroupWrites, x: torch.Tensor) -> bool:
    """This group's share of one decode token (nothing to evict) as native/encode.cpp's
    write_tokens takes it: the same decisions as ``append``, taken here from the counters, and
    the same bytes (a test holds them equal). x (L, B, H, 1, D), contiguous, holds every layer's
    new vectors (the cache's layers, not only the group's: the kernel picks the group's rows).
    True with g's structs set for this token; nothing changes until the write was made and
    ``commit`` called. False where the kernel does not write this codec (``GroupWrites.reason``),
    the dtype, or the first append of centered keys: ``append`` then does it."""
    shared = g.shared
    lead = shared.stores[0]
    if g.reason is not None or x.dtype not in DTYPE_CODE or (lead.centered and lead.center is None):
        return False
    center = g.center16() if lead.centered else None  # (L_group, B, H, 1, D) float16
    g.keep = (x, center)  # what the structs point into, alive until the next token
    g.source(x, center)
    if shared.tier:
        _tier_token_write(shared, g)
    else:
        _token_write(shared, g)
    return True


class GroupWrites:
    """A group's decode-token writes as TokenWrite structs, built on its first decode token: the
    rings' addresses, the codec's tables and the group's layers never change, so a token sets
    only what moves -- the new rows' address, the ring slots and how many rows move. ``main``
    stores the new row (sinks or residual) and codes the row leaving the residual (into the body,
    or the tier); ``flush``, with a tier, decodes the tier's oldest unit and codes it into the
    body, and comes first (a token that moves no unit leaves it a no-op: nothing flushed, no new
    row). ``reason`` says why the kernel does not write the group (then every field is unset).
    The structs live in the cache's one array once ``TokenWrites`` has placed them (``place``);
    ``commit`` moves the counters as ``append`` would have, once the write was made."""

    def __init__(self, shared: LayeredStore):
        lead = shared.stores[0]
        self.shared = shared
        self.layers = shared.layer_index.to(torch.int32)  # (L,) each member's layer in a step's rows
        self.kind, self.tier_kind = _token_kind(lead.codec), _token_kind(lead.tier_codec) if shared.tier else None
        self.reason = _unwritten(shared, self.kind, self.tier_kind)
        self.keep: tuple = ()
        self.centers: tuple[list, torch.Tensor] | None = None  # centered keys: the members' centers, stacked
        self.move: tuple = ()  # what commit moves: (n_flush, leave, rows from the residual, the new row's ring)
        if self.reason is not None:
            return
        self.nowhere, self.to = RingRef(), None  # where main's new row goes now (None: nowhere)
        self.main = self._struct(shared)
        self.structs = [self.main]
        if shared.tier:
            self._into_tier(shared, self.main)
            self.flush = self._struct(shared)
            self._into_body(shared, self.flush)
            f, t = self.flush, lead.tier_codec
            f.src_codes, f.src_scale = ring_ref(shared.tier["codes"]), ring_ref(shared.tier["scale"])
            f.src_levels, f.src_bits, f.src_log_scale = self.tier_kind[2].data_ptr(), t.bits, int(t.log_scale)
            self.structs = [self.flush, self.main]  # the tier's unit leaves a slot before the new row takes it
        else:
            self._into_body(shared, self.main)
        # What a commit moves, read without the rings' properties: (cursor, slots, bytes of a row
        # across the group's layers), and for the body each part's tokens a row.
        n = len(shared.stores)
        self.body = [
            (r.lead.cursor, lead.tokens_per_row[name], r.lead.row_bytes * n) for name, r in shared.body.items()
        ]
        self.tier = [(r.lead.cursor, r.lead.slots, r.lead.row_bytes * n) for r in shared.tier.values()]
        self.residual = (shared.residual.lead.cursor, shared.residual.lead.slots, shared.residual.lead.row_bytes * n)
        data = shared.body["values" if self.kind[0] == 0 else "codes"].lead.cursor
        scale = shared.body["scale"].lead.cursor if "scale" in shared.body else None
        self.body_slots = (data, scale)  # where the body's next coded rows go

    def center16(self) -> torch.Tensor:
        """Every member's key center stacked, (L, B, H, 1, D) float16; made again only when a center changes."""
        centers = [s.center for s in self.shared.stores]  # held below, so an old center's id is never reused
        if self.centers is None or any(a is not b for a, b in zip(centers, self.centers[0])):
            self.centers = (centers, torch.stack(centers).to(torch.float16).contiguous())
        return self.centers[1]

    def place(self, array, at: int) -> int:
        """Copy the structs into array[at:] and work on them there from now on; how many."""
        for i, w in enumerate(self.structs):
            array[at + i] = w
        self.structs = [array[at + i] for i in range(len(self.structs))]  # views of the array's elements
        self.main = self.structs[-1]
        if self.shared.tier:
            self.flush = self.structs[0]
        return len(self.structs)

    def _struct(self, shared: LayeredStore) -> TokenWrite:
        lead = shared.stores[0]
        b, h, _, d = lead.residual.buf.shape  # (B, H, slots, D)
        w = TokenWrite(L=len(shared.stores), BH=b * h, D=d, layers=self.layers.data_ptr())
        w.rotate, w.res = lead.codec.rotation, ring_ref(shared.residual)
        return w

    def _into_body(self, shared: LayeredStore, w: TokenWrite) -> None:
        """w's coded rows go to the body, at the codec's width (slots set per token)."""
        bits, axis, levels, vdim = self.kind
        codec = shared.stores[0].codec
        w.bits, w.group, w.axis = bits, shared.stores[0].group, axis
        w.codes = ring_ref(shared.body["values" if bits == 0 else "codes"])
        if bits:
            w.scale = ring_ref(shared.body["scale"])
            if levels is None:
                w.zero = ring_ref(shared.body["zero"])
            else:  # a codebook: codes and scales, no zeros
                w.levels, w.refine = levels.data_ptr(), REFINE
                w.log_scale = 0 if vdim else int(codec.log_scale)  # vector codes keep fp16 scales
        if vdim:  # levels: the sign-structured book's patterns
            w.vdim, w.patterns = vdim, levels.shape[0]
        if isinstance(codec, FrequencyBlocks):  # each head's blocks at their own widths, one-byte scales
            self.widths = block_widths(codec.widths)  # (H, nb)
            w.blocks, w.widths, w.heads = codec.blocks, self.widths.data_ptr(), self.widths.shape[0]

    def _into_tier(self, shared: LayeredStore, w: TokenWrite) -> None:
        """w's coded row goes to the tier's next row (a codebook: codes, one scale a row of D)."""
        tier = shared.stores[0].tier_codec
        w.bits, w.group, w.axis = tier.bits, w.D, 0
        w.codes, w.scale = ring_ref(shared.tier["codes"]), ring_ref(shared.tier["scale"])
        w.levels, w.refine, w.log_scale = self.tier_kind[2].data_ptr(), REFINE, int(tier.log_scale)

    def source(self, x: torch.Tensor, center: torch.Tensor | None) -> None:
        """The structs read this token's rows from x (L, B, H, 1, D), less the members' key centers."""
        ptr, dtype, c = x.data_ptr(), DTYPE_CODE[x.dtype], center.data_ptr() if center is not None else None
        for w in self.structs:
            w.x, w.dtype, w.center = ptr, dtype, c

    def send(self, to: SharedRing | None) -> None:
        """main's new row goes to the next slot of `to` (sinks or residual), or nowhere."""
        w = self.main
        if to is not self.to:  # a struct field set only when it changes
            w.to, self.to = ring_ref(to) if to is not None else self.nowhere, to
        w.to_slot = (to.lead.start + to.lead.count) % to.lead.slots if to is not None else 0

    def next_body_rows(self, w: TokenWrite) -> None:
        """w's coded rows go to the body's next slots."""
        data, scale = self.body_slots
        w.codes_slot = data.start + data.count
        if scale is not None:
            w.scale_slot = scale.start + scale.count

    def commit(self) -> tuple[int, int]:
        """The described write was made: move the counters as ``append``'s pushes and drops (with
        a tier ``_through_tier``'s) move them for one token; (bytes written, bytes read)."""
        n_flush, leave, r, to = self.move
        written = read = 0
        if n_flush:  # coded into the body: every part advances
            for cursor, per_row, row_bytes in self.body:
                cursor.count += n_flush // per_row
                written += n_flush // per_row * row_bytes
            if self.tier:  # ... from the tier's oldest rows, read
                for cursor, slots, row_bytes in self.tier:
                    cursor.drop_oldest(n_flush, slots)
                    read += n_flush * row_bytes
        cursor, slots, row_bytes = self.residual
        if r:  # rows that left the residual, read
            cursor.drop_oldest(r, slots)
            read += r * row_bytes
        if leave:  # with a tier: one row coded into it
            for cursor, _, row_bytes in self.tier:
                cursor.count += 1
                written += row_bytes
        return written + (to.advance(1) if to is not None else 0), read


def _unwritten(shared: LayeredStore, kind, tier_kind) -> str | None:
    """Why the kernel does not write this group's decode tokens, or None."""
    lead = shared.stores[0]
    if kind is None or lead.residual.buf.dtype != torch.float16:
        return f"{lead.codec.name} is not a codec write_tokens codes"
    if shared.tier and (tier_kind is None or tier_kind[2] is None):
        return "an affine tier"
    if isinstance(lead.codec, FrequencyBlocks) and len(lead.codec.widths) != lead.residual.buf.shape[1]:
        return "a widths table for another head count"  # ``append`` says so
    return None


def _token_write(shared: LayeredStore, g: GroupWrites) -> None:
    """``append``'s decisions for one token without a tier: the new row to the sinks or the
    residual; once ``residual + unit`` wait, the oldest unit coded into the body (the new token
    the unit's last row where the residual holds fewer)."""
    lead, w = shared.stores[0], g.main
    sinks, res = lead.sinks, lead.residual
    to_sinks = sinks.count < sinks.slots
    n_flush = shared.flush_count(res.count + (0 if to_sinks else 1))
    r = min(n_flush, res.count)
    encoded = n_flush - r  # 1: the new token is the block's last row
    to = shared.sinks if to_sinks else None if encoded else shared.residual
    g.send(to)
    w.flush, w.from_res, w.res_first = n_flush, r, res.start
    if n_flush:
        g.next_body_rows(w)
    g.move = (n_flush, 0, r, to)


def _tier_token_write(shared: LayeredStore, g: GroupWrites) -> None:
    """``_through_tier``'s decisions for one token: the flush struct codes the tier's oldest whole
    unit, decoded, into the body (when ``tier + unit`` would wait; else it is a no-op), then main
    codes the residual's oldest row into the tier and stores the new token in its slot."""
    lead = shared.stores[0]
    sinks, res = lead.sinks, lead.residual
    to_sinks = sinks.count < sinks.slots
    leave = 0 if to_sinks else max(0, res.count + 1 - lead.residual_len)  # 0 or 1 row leaves the residual
    n_flush = shared.tier_flush_count(leave) if leave else 0
    f = g.flush
    f.flush = f.from_res = n_flush  # rows of src_*
    if n_flush:  # the tier's oldest unit, decoded, into the body
        f.res_first = shared.tier["codes"].lead.start
        g.next_body_rows(f)
    w = g.main
    r = min(leave, res.count)  # 0 with residual=0: the new token itself goes to the tier
    w.flush, w.from_res, w.res_first = (1, r, res.start) if leave else (0, 0, 0)
    if leave:  # the residual's oldest row (or the new token) into the tier
        codes, scale = shared.tier["codes"].lead, shared.tier["scale"].lead
        w.codes_slot, w.scale_slot = codes.start + codes.count, scale.start + scale.count
    to = shared.sinks if to_sinks else None if leave and not r else shared.residual
    g.send(to)  # the new token into its slot (after the row that leaves is read)
    g.move = (n_flush, leave, r, to)


class TokenWrites:
    """Every group's share of a decode token: the groups' structs end to end in one array, as
    write_tokens takes them (made in order, all or nothing), placed there once for a cache and
    set in place each token; ``finish`` counts what was made."""

    def __init__(self, groups: list[GroupWrites]):
        self.groups = groups
        self.array = (TokenWrite * sum(len(g.structs) for g in groups))()
        at = 0
        for g in groups:
            at += g.place(self.array, at)

    def finish(self) -> tuple[int, int]:
        """The write was made: move every group's counters; (bytes written, bytes read)."""
        written = read = 0
        for g in self.groups:
            w, r = g.commit()
            written, read = written + w, read + r
        return written, read


def _token_kind(codec) -> tuple[int, int, torch.Tensor | None, int] | None:
    """(bits, axis, levels, vdim) for write_tokens: bits 0 for float16 rows, else affine codes and
    their group axis, a Lloyd-Max codebook's codes (per token) and its levels, frequency-block
    keys' average width and the books of every width, or sign-structured vector codes (vdim
    channels a byte) and the book's patterns; None for codecs it does not write."""
    if isinstance(codec, FloatCodec):
        return (0, 0, None, 0) if codec.dtype == torch.float16 else None
    family = native_encoding(codec)
    if family is Affine and codec.bits in (2, 3, 4, 8):
        return codec.bits, int(codec.axis == "channel"), None, 0
    if family is Codebook and codec.bits in (2, 3, 4):
        return codec.bits, 0, gaussian_codebook(codec.bits), 0
    if family is FrequencyBlocks:  # the books of every width end to end, as the attention kernel reads them
        return codec.bits, 0, block_books(), 0
    if family is VectorCodebook:
        return codec.bits, 0, vector_patterns(codec.dim, codec.bits), codec.dim
    return None
