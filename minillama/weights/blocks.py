"""Weights in blocks of 32, as llama.cpp's GGUF files store them (ggml-common.h's block_q8_0,
block_q4_0, block_q4_1): pure functions from float rows to blocks and back.

A row of K weights (K a multiple of 32) is K / 32 blocks, each its own scale:

    q8_0  fp16 d, 32 int8 q             w = d q            34 bytes / 32 weights = 8.5 bits
    q4_0  fp16 d, 16 bytes of nibbles   w = d (q - 8)      18 bytes / 32 weights = 4.5 bits
    q4_1  fp16 d, fp16 m, 16 bytes      w = d q + m        20 bytes / 32 weights = 5.0 bits

In the 4-bit blocks byte j holds weight j in its low nibble and weight j + 16 in its high one.
``quantize`` rounds as ggml's reference quantizers do (``quantize_row_*_ref``), so a row
quantized here is the row llama.cpp would write; ``dequantize`` is the specification every
kernel that reads blocks is held to (tests: both equal the ``gguf`` package's, bit for bit).

The compiled block product may also round its activations to int8 per block of 32, as llama.cpp
multiplies its blocks against Q8_0 activations: ``round_activations`` is that rounding, and
``rounding_bound`` how far it can move a product.
"""

from __future__ import annotations

import torch

QK = 32  # weights per block
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
KINDS = tuple(BLOCK_BYTES)


def _halves(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of every block (..., n, bytes) as float32 (..., n, 1)."""
    return blocks[..., at : at + 2].contiguous().view(torch.float16).float()  # (..., n, 1)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """16 bytes a block (..., n, 16) -> its 32 4-bit codes in weight order (..., n, 32)."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)  # low nibbles are weights 0-15


def dequantize(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """Rows of blocks (N, K / 32 * bytes) uint8 -> weights (N, K) float32."""
    rows = blocks.shape[0]
    b = blocks.view(rows, -1, BLOCK_BYTES[kind])  # (N, K / 32, bytes)
    d = _halves(b, 0)  # (N, K / 32, 1)
    if kind == "q8_0":
        w = d * b[..., 2:].view(torch.int8).float()
    elif kind == "q4_0":
        w = d * (_nibbles(b[..., 2:]).float() - 8)
    else:
        w = d * _nibbles(b[..., 4:]).float() + _halves(b, 2)
    return w.reshape(rows, -1)  # (N, K)


def quantize(w: torch.Tensor, kind: str) -> torch.Tensor:
    """Weights (N, K) -> rows of blocks (N, K / 32 * bytes) uint8, rounded as ggml rounds."""
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
    raise ValueError(f"unknown block kind {kind!r}: choose {', '.join(KINDS)}")


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
