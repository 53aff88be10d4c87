"""A decode token's cache write as native/encode.cpp's ``write_tokens`` takes it.

``LayeredStore.append`` (kv/layered.py) is the cache write, in PyTorch; for a decode step's
single token this module takes the same decisions from the ring counters alone and describes
them as ``TokenWrite`` structs (native/minillama.h), one or two per group of layers: where the
new row goes (sinks or residual), which rows leave the residual (or, with a tier, the tier) and
into which slots of the body their codes go. The cache makes every group's writes in one native
call, all or nothing, then calls each ``PendingWrite.finish`` to move the counters as ``append``
would have. tests/test_cache.py holds the bytes to ``append``'s, token by token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minillama.kv.codecs import Affine, Codebook, FloatCodec
from minillama.kv.freq_blocks import FrequencyBlocks, block_books, block_widths
from minillama.kv.quantize import REFINE, gaussian_codebook
from minillama.kv.write import native_encoding
from minillama.native.abi import DTYPE_CODE, TokenWrite

if TYPE_CHECKING:
    from minillama.kv.layered import LayeredStore, SharedRing


def token_write(shared: LayeredStore, x: torch.Tensor) -> PendingWrite | None:
    """This group's share of one decode token (nothing to evict) as native/encode.cpp's
    write_tokens takes it: the same decisions as ``append``, taken here from the counters, and
    the same bytes (a test holds them equal). Nothing changes until the cache has made the
    write and called ``finish``. None where the kernel does not write this codec (vector codes,
    calibrated ranges, non-float16 rows, the first append of centered keys, a tier whose codec
    is not a codebook): ``append`` then does it."""
    lead = shared.stores[0]
    codec = lead.codec
    kind = _token_kind(codec)
    if kind is None or x.dtype not in DTYPE_CODE or lead.residual.buf.dtype != torch.float16:
        return None
    if shared.tier:
        return _tier_token_write(shared, x, kind)
    if lead.centered and lead.center is None:
        return None
    if isinstance(codec, FrequencyBlocks) and len(codec.widths) != x.shape[2]:
        return None  # a widths table for another head count: ``append`` says so
    sinks, res = lead.sinks, lead.residual
    to_sinks = sinks.count < sinks.slots
    n_flush = shared._flush_count(res.count + (0 if to_sinks else 1))
    r = min(n_flush, res.count)
    encoded = n_flush - r  # 1: the new token is the block's last row
    x = x.contiguous()  # (L, B, H, 1, D)
    center = shared._center16() if lead.centered else None  # (L, B, H, 1, D) float16
    w = _write(shared, x, center)
    to = shared.sinks if to_sinks else None if encoded else shared.residual
    if to is not None:
        w.to, w.to_slot = to.ref, (to.lead.start + to.lead.count) % to.lead.slots
    if n_flush:
        w.flush, w.from_res, w.res, w.res_first = n_flush, r, shared.residual.ref, res.start
        _into_body(shared, w, kind)
    widths = None
    if isinstance(codec, FrequencyBlocks):  # each head's blocks at their own widths, one-byte scales
        widths = block_widths(codec.widths)  # (H, nb)
        w.blocks, w.widths, w.heads = codec.blocks, widths.data_ptr(), widths.shape[0]
    return PendingWrite([w], [x, center, kind[2], widths], lambda: _after_token(shared, n_flush, r, to))


def _write(shared: LayeredStore, x: torch.Tensor, center: torch.Tensor | None) -> TokenWrite:
    """A TokenWrite of x (L, B, H, 1, D) that stores nothing yet (the fields say where)."""
    codec = shared.stores[0].codec
    w = TokenWrite(L=x.shape[0], BH=x.shape[1] * x.shape[2], D=x.shape[-1], dtype=DTYPE_CODE[x.dtype])
    w.x, w.rotate, w.center = x.data_ptr(), codec.rotation, center.data_ptr() if center is not None else None
    return w


def _into_body(shared: LayeredStore, w: TokenWrite, kind) -> None:
    """Point w's encoded block at the next rows of the body (kind: ``_token_kind`` of its codec)."""
    bits, axis, levels = kind
    lead = shared.stores[0]
    w.bits, w.group, w.axis = bits, lead.group, axis
    data = shared.body["values" if bits == 0 else "codes"]
    w.codes, w.codes_slot = data.ref, data.lead.start + data.lead.count
    if bits:
        w.scale = shared.body["scale"].ref
        w.scale_slot = shared.body["scale"].lead.start + shared.body["scale"].lead.count
        if levels is None:
            w.zero = shared.body["zero"].ref
        else:  # a codebook: codes and scales, no zeros
            w.levels, w.refine, w.log_scale = levels.data_ptr(), REFINE, int(lead.codec.log_scale)


def _into_tier(shared: LayeredStore, w: TokenWrite, levels: torch.Tensor) -> None:
    """Point w's encoded block at the tier's next row (a codebook: codes, one scale a row of D)."""
    tier, codes, scale = shared.stores[0].tier_codec, shared.tier["codes"], shared.tier["scale"]
    w.bits, w.group, w.axis = tier.bits, w.D, 0
    w.codes, w.codes_slot = codes.ref, codes.lead.start + codes.lead.count
    w.scale, w.scale_slot = scale.ref, scale.lead.start + scale.lead.count
    w.levels, w.refine, w.log_scale = levels.data_ptr(), REFINE, int(tier.log_scale)


def _tier_token_write(shared: LayeredStore, x: torch.Tensor, kind) -> PendingWrite | None:
    """``token_write`` with a tier (``_through_tier``'s decisions for one token): at most two
    writes, in this order -- the tier's oldest whole unit decoded and coded into the body (when
    ``tier + unit`` would wait), then the residual's oldest row coded into the tier and the new
    token into its slot. None where the tier's codec is not a codebook (``append`` does it)."""
    lead = shared.stores[0]
    tier_kind = _token_kind(lead.tier_codec)
    if tier_kind is None or tier_kind[2] is None or isinstance(lead.codec, FrequencyBlocks):
        return None  # an affine tier, or frequency-block keys beside one: the PyTorch path
    if lead.centered and lead.center is None:
        return None
    x = x.contiguous()  # (L, B, H, 1, D)
    center = shared._center16() if lead.centered else None  # (L, B, H, 1, D) float16
    sinks, res = lead.sinks, lead.residual
    to_sinks = sinks.count < sinks.slots
    leave = 0 if to_sinks else max(0, res.count + 1 - lead.residual_len)  # 0 or 1 row leaves the residual
    n_flush = shared._tier_flush_count(leave) if leave else 0
    writes = []
    if n_flush:  # the tier's oldest unit, decoded, into the body
        w = _write(shared, x, center)
        w.flush, w.from_res, w.res_first = n_flush, n_flush, shared.tier["codes"].lead.start  # rows of src_*
        _into_body(shared, w, kind)
        w.src_codes, w.src_scale = shared.tier["codes"].ref, shared.tier["scale"].ref
        w.src_levels, w.src_bits = tier_kind[2].data_ptr(), lead.tier_codec.bits
        w.src_log_scale = int(lead.tier_codec.log_scale)
        writes.append(w)
    w = _write(shared, x, center)
    r = min(leave, res.count)  # 0 with residual=0: the new token itself goes to the tier
    if leave:  # the residual's oldest row (or the new token) into the tier
        w.flush, w.from_res, w.res, w.res_first = 1, r, shared.residual.ref, res.start
        _into_tier(shared, w, tier_kind[2])
    to = shared.sinks if to_sinks else None if leave and not r else shared.residual
    if to is not None:  # the new token into its slot (after the row that leaves is read)
        w.to, w.to_slot = to.ref, (to.lead.start + to.lead.count) % to.lead.slots
    writes.append(w)
    keep = [x, center, kind[2], tier_kind[2]]
    return PendingWrite(writes, keep, lambda: _after_tier_token(shared, n_flush, leave, r, to))


def _after_tier_token(shared: LayeredStore, n_flush: int, leave: int, r: int, to: SharedRing | None) -> tuple[int, int]:
    """Move the counters as ``_through_tier`` moves them for one token; (bytes written, bytes read)."""
    lead, n_layers = shared.stores[0], len(shared.stores)
    written = read = 0
    if n_flush:
        written += _advance_body(shared, n_flush)
        read += shared._drop_tier(n_flush)
    if leave:
        read += r * lead.residual.row_bytes * n_layers
        shared.residual.drop_oldest(r)
        for ring in shared.tier.values():
            written += ring.advance(1)
    return written + (to.advance(1) if to is not None else 0), read


def _after_token(shared: LayeredStore, n_flush: int, r: int, to: SharedRing | None) -> tuple[int, int]:
    """Move the counters as ``append``'s pushes and drops move them; (bytes written, bytes read)."""
    lead = shared.stores[0]
    written = read = 0
    if n_flush:
        written += _advance_body(shared, n_flush)
        read += r * lead.residual.row_bytes * len(shared.stores)
        shared.residual.drop_oldest(r)
    if to is not None:
        written += to.advance(1)
    return written, read


def _advance_body(shared: LayeredStore, n: int) -> int:
    """n tokens were coded into every layer's body (by the kernel): count them; bytes written."""
    lead = shared.stores[0]
    written = sum(ring.advance(n // lead.tokens_per_row[name]) for name, ring in shared.body.items())
    for store in shared.stores:
        store.n_body += n
    return written


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
