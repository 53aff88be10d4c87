"""Keys in RoPE frequency blocks: per KV head, each block's own Lloyd-Max width (``lm{b}f{nb}``).

A score's quantization error is sum_c q_c e_c, so where a head's queries and keys put their
energy decides where key bits pay (KVTuner; Block-GTQ's per-RoPE-block allocation). RoPE pairs
channel f with f + D/2 at one frequency; a *block* holds a run of neighbouring frequencies with
both channels of each pair (quantize.py: ``frequency_block_order``), rotated by its own Hadamard
matrix (``block_rotate``) so that its error stays inside it. Each KV head gives each block its
own width, chosen once per model from a text's queries and keys (the choice and what it buys:
docs/archive/frontiers.md, Frontier IX); the table is spelled in the codec's
name, so a spec, a cache file and ``minillama kv`` all carry it.

Bits per element: b + 8 nb / D (every head's widths add up to nb x b, plus one byte scale a
block). The kernels read these rows through the rows route: sixteen channels at a time on
AVX-512 builds (native/avx512_attention.cpp: score_blocks), eight on AVX2 builds
(avx2_attention.cpp), one row at a time elsewhere (native/row_attention.cpp); the query is
rotated block by block in layer_attention.cpp. When the kernels run, the cache write rotates the
new keys by block and encodes each block in C++ (native/encode.cpp: prepare_rows,
encode_codebook; kv/write.py), byte for byte the PyTorch path.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import ClassVar

import torch

from minillama.errors import UserError
from minillama.kv import packing
from minillama.kv.codecs import Codec, PartSpec, RowKind
from minillama.kv.quantize import (
    block_rotate,
    block_unrotate,
    check_finite,
    dequantize_codebook,
    gaussian_codebook,
    quantize_codebook,
)


def code_block(xb: torch.Tensor, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One block (..., n) at width w: Lloyd-Max codes packed at w bits, and one-byte log scales (..., 1)."""
    c, s = quantize_codebook(xb, w, xb.shape[-1], log_scale=True)  # (..., n), (..., 1)
    return packing.pack(c, w), s


@functools.cache
def block_books() -> torch.Tensor:
    """The Lloyd-Max books of widths 1-8 end to end, width w's at 2^w - 2 (510,): what the kernels
    read block codes against. Made once; nothing writes to it."""
    return torch.cat([gaussian_codebook(w) for w in range(1, 9)])


@functools.lru_cache(maxsize=64)
def block_widths(widths: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """A widths table as the kernels take it, (H, nb) int16; made once per table."""
    return torch.tensor(widths, dtype=torch.int16)


@dataclass(frozen=True)
class FrequencyBlocks(Codec):
    """One per-model table: per KV head, each frequency block's width, highest frequencies first
    (``lm3f2:24.33``: head 0 two and four bits, head 1 three and three). Each block is rotated by
    its own Hadamard matrix (n = D / nb channels) and coded with the Gaussian Lloyd-Max book of its
    width and one one-byte log scale; a width of 0 drops the block (it decodes to zeros). The scale
    group G is unused: a scale a block."""

    widths: tuple[tuple[int, ...], ...] = ((),)  # per KV head, each block's bits
    row_kind: ClassVar[RowKind] = RowKind.BLOCKS  # decoded a row at a time (native/row_attention.cpp)
    log_scale: ClassVar[bool] = True  # every block's scale is one byte (as Codebook's with log_scale)

    @property
    def blocks(self) -> int:
        return len(self.widths[0])

    @property
    def rotation(self) -> int:
        return self.blocks

    def kernel_tables(self):
        """The Lloyd-Max books of widths 1-8 end to end (width w's at 2^w - 2), and the widths
        (H, nb) the kernel reads per head (kv/fused_attention.py repeats them per sequence)."""
        return {"codebook": block_books(), "widths": block_widths(self.widths)}

    def kernel_fields(self):
        return {"nlevels": self.blocks}

    @property
    def packing(self) -> int | str:
        return self.bits  # the row's bytes; blocks pack at their own widths inside it

    def bits_formula(self) -> str:
        return (
            f"{self.bits} + {8 * self.blocks}/D  (per KV head and RoPE frequency block: Lloyd-Max bits, a byte scale)"
        )

    def validate(self, head_dim: int, group: int) -> None:
        n = head_dim // self.blocks if head_dim % (2 * self.blocks) == 0 else 0
        if n < 8 or n & (n - 1):
            raise UserError(
                f"codec {self.name} splits a head into {self.blocks} frequency blocks, each rotated on its own: "
                f"head_dim {head_dim} needs blocks of a power-of-two size of at least 8 channels"
            )

    def parts(self, head_dim: int, group: int) -> list[PartSpec]:
        return [self.codes_part(head_dim), PartSpec("scale", torch.uint8, self.blocks, 1)]

    def to_space(self, x: torch.Tensor) -> torch.Tensor:
        return block_rotate(x, self.blocks)

    def from_space(self, y: torch.Tensor) -> torch.Tensor:
        return block_unrotate(y, self.blocks)

    def _heads(self, h: int) -> None:
        if h != len(self.widths):
            raise UserError(
                f"codec {self.name} gives widths for {len(self.widths)} KV heads; this model has {h}: "
                "choose a table for it (docs/archive/frontiers.md, Frontier IX)"
            )

    def encode(self, x, group):
        check_finite(x)
        return self.encode_blocks(x, code_block)

    def encode_blocks(self, x: torch.Tensor, coder) -> dict[str, torch.Tensor]:
        """x (B, H, T, D) in storage space (block_rotate'd) -> the parts, each block of each head
        coded by ``coder(xb, w)``: xb (B, 1, T, n) -> packed codes (B, 1, T, n w / 8) and one-byte
        scales (B, 1, T, 1) (``code_block``, or native/encode.cpp's encoder: kv/write.py)."""
        b, h, t, d = x.shape
        self._heads(h)
        n = d // self.blocks
        codes, scales = [], []
        for head, widths in enumerate(self.widths):
            packed, scale = [], []
            for i, w in enumerate(widths):
                xb = x[:, head : head + 1, :, i * n : (i + 1) * n]  # (B, 1, T, n): one block of one head
                if w == 0:
                    scale.append(torch.zeros(b, 1, t, 1, dtype=torch.uint8, device=x.device))
                    continue
                c, s = coder(xb, w)  # (B, 1, T, n w / 8), (B, 1, T, 1)
                packed.append(c)
                scale.append(s)
            codes.append(torch.cat(packed, dim=-1))  # (B, 1, T, D bits / 8)
            scales.append(torch.cat(scale, dim=-1))  # (B, 1, T, nb)
        return {"codes": torch.cat(codes, dim=1), "scale": torch.cat(scales, dim=1)}

    def _blocks(self, parts: dict[str, torch.Tensor], head_dim: int):
        """(head, block, width, codes (B, 1, T, n) or None, scale (B, 1, T, 1)) for every block."""
        self._heads(parts["codes"].shape[1])
        n = head_dim // self.blocks
        for head, widths in enumerate(self.widths):
            row, at = parts["codes"][:, head : head + 1], 0  # (B, 1, T, row bytes)
            for i, w in enumerate(widths):
                codes = packing.unpack(row[..., at : at + n * w // 8], w, n) if w else None
                at += n * w // 8
                yield head, i, w, codes, parts["scale"][:, head : head + 1, :, i : i + 1]

    def unpack(self, parts, head_dim):
        b, h, t, _ = parts["codes"].shape
        out = torch.zeros(b, h, t, head_dim, dtype=torch.uint8, device=parts["codes"].device)
        n = head_dim // self.blocks
        for head, i, _, codes, _ in self._blocks(parts, head_dim):
            if codes is not None:
                out[:, head : head + 1, :, i * n : (i + 1) * n] = codes
        return out  # (B, H, T, D): each block's codes in its channels

    def decode(self, parts, group, head_dim):
        b, h, t, _ = parts["codes"].shape
        out = torch.zeros(b, h, t, head_dim, device=parts["codes"].device)
        n = head_dim // self.blocks
        for head, i, w, codes, scale in self._blocks(parts, head_dim):
            if codes is not None:
                out[:, head : head + 1, :, i * n : (i + 1) * n] = dequantize_codebook(codes, scale, w, n)
        return out  # (B, H, T, D) float32, storage space


_BLOCKS_NAME = re.compile(r"^lm(\d)f(\d):(\d+(?:\.\d+)*)$")


@functools.lru_cache(maxsize=64)
def frequency_blocks(name: str) -> FrequencyBlocks | None:
    """The FrequencyBlocks codec a name like ``lm3f2:24.33.15`` spells, None if it spells none; a
    UserError saying what is wrong with one that is almost such a name."""
    m = _BLOCKS_NAME.match(name)
    if not m:
        return None
    bits, nb = int(m.group(1)), int(m.group(2))
    heads = m.group(3).split(".")
    if not 1 <= bits <= 8 or nb not in (1, 2, 4, 8):
        raise UserError(f"codec {name}: lm{{bits}}f{{blocks}} takes 1-8 bits and 1, 2, 4 or 8 blocks")
    widths = tuple(tuple(int(c) for c in head) for head in heads)
    if any(len(w) != nb or sum(w) != nb * bits for w in widths):
        raise UserError(
            f"codec {name}: every KV head needs {nb} widths (one digit a block) adding up to {nb * bits} "
            f"({nb} blocks at {bits} bits on average), e.g. lm{bits}f{nb}:{str(bits) * nb}"
        )
    return FrequencyBlocks(name, bits, "per KV head and RoPE frequency block widths", rotate=True, widths=widths)
