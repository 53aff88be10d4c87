"""Bit packing of quantization codes into uint8 tensors (pure functions).

Codes are small unsigned integers along the last dimension; packing is real, so the
bytes a cache holds are the bytes these functions return:

* 8 bits: one code per byte (identity).
* 4 bits: two codes per byte, the first code in the low nibble.
* 2 bits: four codes per byte, the first code in the lowest two bits.
* 3 bits: eight codes in three bytes (a little-endian 24-bit word per 8 codes).
* 1, 5, 6 or 7 bits: the same little-endian bit stream (code i at bits i b .. i b + b - 1 of
  the row), which every width above also is; only frequency-block codecs use these widths.
* trits (values 0, 1, 2): five per byte as a base-3 number, since 3**5 = 243 <= 256;
  the last byte of a row is padded with zeros when the row length is not a multiple of 5.
"""

from __future__ import annotations

import math

import torch

_TRIT_POWERS = (1, 3, 9, 27, 81)


def packed_width(n: int, bits: int | str) -> int:
    """Bytes needed for a row of n codes."""
    if bits == "trit":
        return -(-n // 5)
    return n * int(bits) // 8


def check_packable(n: int, bits: int | str) -> None:
    per = {8: 1, 4: 2, 2: 4, 3: 8, "trit": 1}.get(bits) or 8 // math.gcd(int(bits), 8)
    if n % per:
        raise ValueError(f"a row of {n} codes cannot be packed at {bits} bits (needs a multiple of {per})")


def pack(codes: torch.Tensor, bits: int | str) -> torch.Tensor:
    """codes (..., n) uint8 with values < 2**bits (or < 3 for trits) -> (..., packed_width(n))."""
    n = codes.shape[-1]
    check_packable(n, bits)
    c = codes.to(torch.uint8)
    if bits == 8:
        return c.clone()
    if bits == 4:
        return c[..., 0::2] | (c[..., 1::2] << 4)  # (..., n/2)
    if bits == 2:
        return c[..., 0::4] | (c[..., 1::4] << 2) | (c[..., 2::4] << 4) | (c[..., 3::4] << 6)  # (..., n/4)
    if bits == 3:
        g = c.reshape(*c.shape[:-1], n // 8, 8).to(torch.int32)  # (..., n/8, 8)
        shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=c.device)  # (8,)
        word = (g << shifts).sum(-1)  # (..., n/8) 24-bit words
        out = torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], dim=-1)  # (..., n/8, 3)
        return out.to(torch.uint8).reshape(*c.shape[:-1], n // 8 * 3)
    if bits == "trit":
        pad = packed_width(n, bits) * 5 - n
        g = torch.nn.functional.pad(c, (0, pad)).reshape(*c.shape[:-1], -1, 5).to(torch.int32)  # (..., w, 5)
        powers = torch.tensor(_TRIT_POWERS, dtype=torch.int32, device=c.device)
        return (g * powers).sum(-1).to(torch.uint8)  # (..., w)
    if bits in (1, 5, 6, 7):
        per = 8 // math.gcd(bits, 8)  # codes per whole number of bytes
        g = c.reshape(*c.shape[:-1], n // per, per).to(torch.int64)  # (..., n/per, per)
        word = (g << torch.arange(0, per * bits, bits, device=c.device)).sum(-1)  # (..., n/per) little-endian words
        nbytes = per * bits // 8
        out = torch.stack([(word >> (8 * i)) & 0xFF for i in range(nbytes)], dim=-1)  # (..., n/per, nbytes)
        return out.to(torch.uint8).reshape(*c.shape[:-1], n // per * nbytes)
    raise ValueError(f"unsupported packing {bits!r}")


def unpack(packed: torch.Tensor, bits: int | str, n: int) -> torch.Tensor:
    """Inverse of pack: (..., packed_width(n)) uint8 -> codes (..., n) uint8."""
    p = packed
    if bits == 8:
        return p
    if bits == 4:
        return torch.stack([p & 0xF, p >> 4], dim=-1).reshape(*p.shape[:-1], n)
    if bits == 2:
        return torch.stack([(p >> s) & 0x3 for s in (0, 2, 4, 6)], dim=-1).reshape(*p.shape[:-1], n)
    if bits == 3:
        b = p.reshape(*p.shape[:-1], n // 8, 3).to(torch.int32)  # (..., n/8, 3)
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)  # (..., n/8)
        shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=p.device)  # (8,)
        return ((word[..., None] >> shifts) & 0x7).to(torch.uint8).reshape(*p.shape[:-1], n)
    if bits == "trit":
        v = p.to(torch.int32)[..., None]  # (..., w, 1)
        powers = torch.tensor(_TRIT_POWERS, dtype=torch.int32, device=p.device)
        trits = (v // powers) % 3  # (..., w, 5)
        return trits.reshape(*p.shape[:-1], -1)[..., :n].to(torch.uint8)
    if bits in (1, 5, 6, 7):
        per = 8 // math.gcd(bits, 8)
        nbytes = per * bits // 8
        b = p.reshape(*p.shape[:-1], n // per, nbytes).to(torch.int64)  # (..., n/per, nbytes)
        word = (b << torch.arange(0, 8 * nbytes, 8, device=p.device)).sum(-1)  # (..., n/per)
        shifts = torch.arange(0, per * bits, bits, device=p.device)  # (per,)
        return ((word[..., None] >> shifts) & ((1 << bits) - 1)).to(torch.uint8).reshape(*p.shape[:-1], n)
    raise ValueError(f"unsupported packing {bits!r}")
