"""Weights in blocks, as llama.cpp's GGUF files store them (ggml-common.h's block_q8_0,
block_q4_0, block_q4_1, and the k-quants' block_q4_K and block_q6_K): pure functions from float
rows to blocks and back.

A row of K weights is K / QK blocks (QK = WEIGHTS[kind]: 32, or 256 for the k-quants), each its
own scale:

    q8_0  fp16 d, 32 int8 q             w = d q            34 bytes / 32 weights = 8.5 bits
    q4_0  fp16 d, 16 bytes of nibbles   w = d (q - 8)      18 bytes / 32 weights = 4.5 bits
    q4_1  fp16 d, fp16 m, 16 bytes      w = d q + m        20 bytes / 32 weights = 5.0 bits
    q4_k  fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) for 8 sub-blocks of 32, 128 bytes of
          nibbles                       w = (d sc) q - (dmin m)       144 / 256 = 4.5 bits
    q6_k  128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16 weights),
          fp16 d                        w = (d sc) (q - 32)           210 / 256 = 6.56 bits

In q4_0/q4_1 byte j holds weight j in its low nibble and weight j + 16 in its high one; in q4_k
byte j of each 32 holds weight j of a 64-weight group low and weight j + 32 high (the layouts of
q6_k: ``_q6_k``).
``quantize`` rounds as ggml's reference quantizers do (``quantize_row_*_ref``), so a row
quantized here is the row llama.cpp would write (q6_k, for heads: its layout, without its search
for the least-error scale); ``dequantize`` is the specification every
kernel that reads blocks is held to (tests: both equal the ``gguf`` package's, bit for bit).

The compiled block product may also round its activations to int8 per block of 32, as llama.cpp
multiplies its blocks against Q8_0 activations: ``round_activations`` is that rounding, and
``rounding_bound`` how far it can move a product.
"""

from __future__ import annotations

import torch

QK = 32  # weights per block (per sub-block of the k-quants)
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q4_k": 144, "q6_k": 210}
WEIGHTS = {"q8_0": 32, "q4_0": 32, "q4_1": 32, "q4_k": 256, "q6_k": 256}  # weights per block
KINDS = ("q8_0", "q4_0", "q4_1")  # what --weights quantizes a model to (`quantize` writes q6_k too: heads)


def _halves(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of every block (..., n, bytes) as float32 (..., n, 1)."""
    return blocks[..., at : at + 2].contiguous().view(torch.float16).float()  # (..., n, 1)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """16 bytes a block (..., n, 16) -> its 32 4-bit codes in weight order (..., n, 32)."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)  # low nibbles are weights 0-15


def dequantize(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """Rows of blocks (N, K / QK * bytes) uint8 -> weights (N, K) float32."""
    rows = blocks.shape[0]
    b = blocks.view(rows, -1, BLOCK_BYTES[kind])  # (N, K / QK, bytes)
    if kind == "q4_k":
        return _q4_k(b).reshape(rows, -1)  # (N, K)
    if kind == "q6_k":
        return _q6_k(b).reshape(rows, -1)
    d = _halves(b, 0)  # (N, K / 32, 1)
    if kind == "q8_0":
        w = d * b[..., 2:].view(torch.int8).float()
    elif kind == "q4_0":
        w = d * (_nibbles(b[..., 2:]).float() - 8)
    else:
        w = d * _nibbles(b[..., 4:]).float() + _halves(b, 2)
    return w.reshape(rows, -1)  # (N, K)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    """q4_k blocks (N, n, 144) -> weights (N, n, 256)."""
    d, dmin = _halves(b, 0), _halves(b, 2)  # (N, n, 1)
    s = b[..., 4:16].long()  # 12 bytes: 6-bit scales and mins of 8 sub-blocks
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], -1).float()  # (N, n, 8)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], -1).float()
    qs = b[..., 16:].reshape(*b.shape[:-1], 4, 32)  # (N, n, 4 groups of 64 weights, 32 bytes)
    q = torch.stack([qs & 15, qs >> 4], -2).reshape(*b.shape[:-1], 8, 32).float()  # (N, n, 8, 32)
    return ((d * sc).unsqueeze(-1) * q - (dmin * mn).unsqueeze(-1)).flatten(-2)  # (N, n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    """q6_k blocks (N, n, 210) -> weights (N, n, 256). Per half of 128 weights: 64 bytes of low
    nibbles (weights 0-63 low, 64-127 high) and 32 bytes of high pairs (bits 2i, 2i+1 of byte l
    are weight l + 32 i's)."""
    ql = b[..., :128].reshape(*b.shape[:-1], 2, 1, 64)  # (N, n, half, 1, 64)
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32)
    low = torch.cat([ql & 15, ql >> 4], -2).reshape(*b.shape[:-1], 2, 4, 32)  # (N, n, half, 4, 32)
    high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], -2)  # (N, n, half, 4, 32)
    q = ((low | (high << 4)).to(torch.int16) - 32).reshape(*b.shape[:-1], 16, 16).float()  # (N, n, 16, 16)
    sc = b[..., 192:208].contiguous().view(torch.int8).float()  # (N, n, 16)
    d = _halves(b, 208)  # (N, n, 1)
    return ((d * sc).unsqueeze(-1) * q).flatten(-2)  # (N, n, 256)


def quantize(w: torch.Tensor, kind: str) -> torch.Tensor:
    """Weights (N, K) -> rows of blocks (N, K / QK * bytes) uint8, rounded as ggml rounds (q6_k:
    ``_quantize_q6_k``)."""
    rows, k = w.shape
    if k % QK:
        raise ValueError(f"{k} columns is not a multiple of {QK}: {kind} blocks need whole blocks")
    x = w.float().reshape(rows, k // QK, QK)  # (N, K / 32, 32)
    if kind == "q8_0":
        d = x.abs().amax(-1, keepdim=True) / 127  # (N, K / 32, 1)
        inv = torch.where(d > 0, 1 / d, 0.0)
        v = x * inv
        q = torch.sign(v) * torch.floor(v.abs() + 0.5)  # ggml's roundf: halves away from zero
        return _pack(rows, [_half(d), q.to(torch.int8).view(torch.uint8)])
    if kind == "q4_0":
        at = x.abs().argmax(-1, keepdim=True)  # the weight of largest magnitude, with its sign
        d = x.gather(-1, at) / -8
        inv = torch.where(d != 0, 1 / d, 0.0)
        q = (x * inv + 8.5).to(torch.int8).clamp(max=15).to(torch.uint8)  # truncation, as (int8_t) in C
        return _pack(rows, [_half(d), q[..., :16] | (q[..., 16:] << 4)])
    if kind == "q4_1":
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        inv = torch.where(d != 0, 1 / d, 0.0)
        q = ((x - lo) * inv + 0.5).to(torch.int8).clamp(max=15).to(torch.uint8)
        return _pack(rows, [_half(d), _half(lo), q[..., :16] | (q[..., 16:] << 4)])
    if kind == "q6_k":
        return _quantize_q6_k(w.float())
    raise ValueError(f"unknown block kind {kind!r}: choose {', '.join(KINDS)}")


def _quantize_q6_k(w: torch.Tensor) -> torch.Tensor:
    """Weights (N, K) -> q6_k blocks (N, K / 256 * 210), K a multiple of 256: ggml's reference
    layout and scale rounding without its search for the scale of least error -- each 16 weights'
    scale puts its largest weight on code -32 (as q4_0 does on -8), d puts the largest of a block's
    16 scales on -128, and every weight takes the nearest code of its rounded scale."""
    rows, k = w.shape
    if k % 256:
        raise ValueError(f"{k} columns is not a multiple of 256: q6_k blocks need whole blocks")
    x = w.reshape(rows, k // 256, 16, 16)  # (N, n, 16 scales, 16 weights)
    scale = x.gather(-1, x.abs().argmax(-1, keepdim=True)) / -32  # (N, n, 16, 1)
    d = scale.gather(-2, scale.abs().argmax(-2, keepdim=True)) / -128  # (N, n, 1, 1)
    d = d.to(torch.float16).float()  # as stored
    sc = torch.round(torch.where(d != 0, scale / d, 0.0)).clamp(-128, 127)  # (N, n, 16, 1)
    step = d * sc
    q = (torch.round(torch.where(step != 0, x / step, 0.0)).clamp(-32, 31) + 32).to(torch.uint8)  # (N, n, 16, 16)
    q = q.reshape(rows, k // 256, 2, 4, 32)  # (N, n, half, 4 groups of 32, 32)
    ql = (q[..., 0:2, :] & 15).flatten(-2) | ((q[..., 2:4, :] & 15).flatten(-2) << 4)  # (N, n, half, 64)
    hi = q >> 4  # (N, n, half, 4, 32): 2 bits each
    qh = hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)  # (N, n, half, 32)
    scales = sc.squeeze(-1).to(torch.int8).view(torch.uint8)  # (N, n, 16)
    fields = [ql.flatten(-2), qh.flatten(-2), scales, _half(d.reshape(rows, -1, 1))]
    return torch.cat(fields, dim=-1).reshape(rows, -1).contiguous()  # (N, n * 210)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """Rows (M, K) -> the same rows rounded to int8 codes per block of 32, each block's scale
    s = amax / 127 (float32): s * round(x * 127 / amax), ties to even (native/linear.cpp rounds so)."""
    b = x.float().reshape(*x.shape[:-1], -1, QK)  # (M, K / 32, 32)
    amax = b.abs().amax(-1, keepdim=True)  # (M, K / 32, 1)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0.0)  # (`127 / amax` rounds twice)
    return ((amax / 127) * torch.round(b * inv)).reshape(x.shape)  # (M, K)


def rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far rounding x (M, K) per block can move x @ w.T (w (N, K) the weights): each element
    moves by at most half its block's step (amax / 254), so an output by at most the sum over
    blocks of amax / 254 times the block's sum of |w|. -> (M, N)"""
    half_step = x.float().reshape(x.shape[0], -1, QK).abs().amax(-1) / 254  # (M, K / 32)
    l1 = w.float().abs().reshape(w.shape[0], -1, QK).sum(-1)  # (N, K / 32)
    return half_step @ l1.T  # (M, N)


def _half(x: torch.Tensor) -> torch.Tensor:
    """float32 (..., 1) -> its fp16 bytes (..., 2)."""
    return x.to(torch.float16).view(torch.uint8)


def _pack(rows: int, fields: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(fields, dim=-1).reshape(rows, -1).contiguous()  # (N, K / 32 * bytes)
