"""KV codecs: what is stored per token for one tensor (K or V), and how many bytes it takes.

A codec turns a block of key or value vectors (B, H, T, D) into named *parts* (packed
codes, scales, zeros) and back. It only arranges calls to the pure quantizers in
``quantize.py`` and ``packing.py``; it holds no state. The cache (``cache.py``) owns the
buffers that parts are written into; the ``--kv`` spec that picks codecs is ``spec.py``.

Every part is a tensor (B, H, rows, width); a row covers ``tokens_per_row`` tokens
(1 for per-token parts, the group size for the per-channel scales of KIVI keys).

Calibrated codecs (kind "calib": ``int4cs``..., ``nuq4``...) keep per-sequence
*parameters* besides their parts: a range per channel (and for ``nuq`` a fitted grid per
head), fitted once on the first tokens the sequence quantizes; the store holds them and
passes them to ``encode``/``decode``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillama.kv import packing
from minillama.errors import UserError
from minillama.kv.quantize import (
    check_finite,
    dequantize_affine,
    dequantize_codebook,
    dequantize_levels,
    dequantize_ternary,
    fit_channel_range,
    fit_levels,
    hadamard_rotate,
    quantize_affine,
    quantize_codebook,
    quantize_levels,
    quantize_ternary,
    uniform_levels,
)

FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PartSpec:
    name: str
    dtype: torch.dtype
    width: int  # elements per row
    tokens_per_row: int


@dataclass(frozen=True)
class Codec:
    name: str
    kind: str  # "float" | "token" | "channel" | "ternary" | "codebook" | "calib"
    bits: int
    rotate: bool = False
    about: str = ""
    fitted: bool = False  # calib codecs: a grid fitted per sequence (nuq) instead of the uniform one

    @property
    def quantized(self) -> bool:
        return self.kind != "float"

    @property
    def float_dtype(self) -> torch.dtype:
        return FLOAT_DTYPES[self.name]

    def unit(self, group: int) -> int:
        """Tokens that must be quantized together: a whole group for per-channel codecs."""
        return group if self.kind == "channel" else 1

    def packing(self) -> int | str:
        return "trit" if self.kind == "ternary" else self.bits

    def bits_formula(self) -> str:
        if self.kind == "float":
            return f"{self.bits}"
        if self.kind == "ternary":
            return "8/5 + 16/G  (5 trits per byte, fp16 scale per G channels)"
        if self.kind == "codebook":
            return f"{self.bits} + 16/G  (Gaussian Lloyd-Max levels, fp16 RMS scale per G channels)"
        if self.kind == "calib":
            grid = f" + {2 ** self.bits} fp16 levels" if self.fitted else ""
            return f"{self.bits} + (32 D{grid})/(D T) (fp16 lo + span per channel{grid}, once per sequence)"
        where = "G tokens, per channel" if self.kind == "channel" else "G channels"
        return f"{self.bits} + 32/G  (fp16 scale + zero per {where})"

    def validate(self, head_dim: int, group: int) -> None:
        if self.rotate and head_dim & (head_dim - 1):
            raise UserError(f"codec {self.name} needs a power-of-two head_dim for the Hadamard rotation, got {head_dim}")
        if self.kind in ("token", "ternary", "codebook") and head_dim % group:
            raise UserError(f"group={group} does not divide head_dim={head_dim}: pick a divisor of {head_dim}")
        if self.quantized:
            try:
                packing.check_packable(head_dim, self.packing())
            except ValueError as e:
                raise UserError(f"codec {self.name}: {e}") from None

    def parts(self, head_dim: int, group: int) -> list[PartSpec]:
        if self.kind == "float":
            return [PartSpec("values", self.float_dtype, head_dim, 1)]
        codes = PartSpec("codes", torch.uint8, packing.packed_width(head_dim, self.packing()), 1)
        if self.kind in ("ternary", "codebook"):
            return [codes, PartSpec("scale", torch.float16, head_dim // group, 1)]
        if self.kind == "calib":
            return [codes]  # the ranges are per sequence: see param_bytes
        if self.kind == "channel":
            return [codes, PartSpec("scale", torch.float16, head_dim, group), PartSpec("zero", torch.float16, head_dim, group)]
        return [codes, PartSpec("scale", torch.float16, head_dim // group, 1), PartSpec("zero", torch.float16, head_dim // group, 1)]

    def bytes_per_token(self, head_dim: int, group: int) -> float:
        """Stored bytes per token per KV head (scales of per-channel groups spread over G tokens)."""
        return sum(p.width * p.dtype.itemsize / p.tokens_per_row for p in self.parts(head_dim, group))

    def param_bytes(self, head_dim: int) -> int:
        """Bytes of per-sequence parameters per KV head (calib codecs): lo and span per channel, the grid."""
        if self.kind != "calib":
            return 0
        return 2 * head_dim * 2 + (2**self.bits * 2 if self.fitted else 0)

    def calibrate(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-sequence parameters from x (B, H, T, D): lo, span (B, H, 1, D) and levels (B, H, 2**bits)."""
        lo, span = fit_channel_range(x)
        levels = fit_levels(x, lo, span, self.bits) if self.fitted else uniform_levels(self.bits, x.shape[:-2])
        return {"lo": lo, "span": span, "levels": levels}

    def to_space(self, x: torch.Tensor) -> torch.Tensor:
        """Map vectors into the space they are stored in (rotated for Hadamard codecs)."""
        return hadamard_rotate(x) if self.rotate else x

    def encode(self, x: torch.Tensor, group: int, params: dict | None = None) -> dict[str, torch.Tensor]:
        """x (B, H, T, D), already in storage space -> parts, each (B, H, rows, width)."""
        if self.kind == "float":
            check_finite(x)
            return {"values": x.to(self.float_dtype)}
        bits = self.packing()
        if self.kind == "calib":
            check_finite(x)
            return {"codes": packing.pack(quantize_levels(x, params["lo"], params["span"], params["levels"]), bits)}
        if self.kind == "ternary":
            codes, scale = quantize_ternary(x, group)
            return {"codes": packing.pack(codes, bits), "scale": scale}
        if self.kind == "codebook":
            codes, scale = quantize_codebook(x, self.bits, group)
            return {"codes": packing.pack(codes, bits), "scale": scale}
        codes, scale, zero = quantize_affine(x, self.bits, group, "channel" if self.kind == "channel" else "token")
        return {"codes": packing.pack(codes, bits), "scale": scale, "zero": zero}

    def decode(self, parts: dict[str, torch.Tensor], group: int, head_dim: int, params: dict | None = None) -> torch.Tensor:
        """parts -> float32 (B, H, T, D), still in storage space."""
        if self.kind == "float":
            return parts["values"].float()
        codes = packing.unpack(parts["codes"], self.packing(), head_dim)  # (B, H, T, D)
        if self.kind == "calib":
            return dequantize_levels(codes, params["lo"], params["span"], params["levels"])
        if self.kind == "ternary":
            return dequantize_ternary(codes, parts["scale"], group)
        if self.kind == "codebook":
            return dequantize_codebook(codes, parts["scale"], self.bits, group)
        axis = "channel" if self.kind == "channel" else "token"
        return dequantize_affine(codes, parts["scale"], parts["zero"], group, axis)


CODECS: dict[str, Codec] = {
    c.name: c
    for c in [
        Codec("fp32", "float", 32, about="unquantized float32"),
        Codec("bf16", "float", 16, about="unquantized bfloat16"),
        Codec("fp16", "float", 16, about="unquantized float16"),
        Codec("int8", "token", 8, about="per-token groups of G channels"),
        Codec("int4", "token", 4, about="per-token groups of G channels"),
        Codec("int3", "token", 3, about="per-token groups of G channels, 8 codes in 3 bytes"),
        Codec("int2", "token", 2, about="per-token groups of G channels"),
        Codec("int8c", "channel", 8, about="KIVI per-channel, groups of G tokens"),
        Codec("int4c", "channel", 4, about="KIVI per-channel, groups of G tokens"),
        Codec("int3c", "channel", 3, about="KIVI per-channel, groups of G tokens, 8 codes in 3 bytes"),
        Codec("int2c", "channel", 2, about="KIVI per-channel, groups of G tokens"),
        Codec("int4cs", "calib", 4, about="per-channel range fitted once per sequence on its prefill (KVQuant)"),
        Codec("int3cs", "calib", 3, about="per-channel range fitted once per sequence on its prefill (KVQuant)"),
        Codec("int2cs", "calib", 2, about="per-channel range fitted once per sequence on its prefill (KVQuant)"),
        Codec("nuq4", "calib", 4, fitted=True, about="per-sequence channel ranges + a grid per head fitted on the prefill"),
        Codec("nuq3", "calib", 3, fitted=True, about="per-sequence channel ranges + a grid per head fitted on the prefill"),
        Codec("nuq2", "calib", 2, fitted=True, about="per-sequence channel ranges + a grid per head fitted on the prefill"),
        Codec("int4h", "token", 4, rotate=True, about="Hadamard-rotated, then per-token groups"),
        Codec("int3h", "token", 3, rotate=True, about="Hadamard-rotated, then per-token groups"),
        Codec("int2h", "token", 2, rotate=True, about="Hadamard-rotated, then per-token groups"),
        Codec("tern", "ternary", 2, about="ternary {-1,0,+1} x fp16 scale per G channels"),
        Codec("ternh", "ternary", 2, rotate=True, about="Hadamard-rotated ternary"),
        Codec("lm4h", "codebook", 4, rotate=True, about="Hadamard-rotated, Gaussian Lloyd-Max levels (TurboQuant-style)"),
        Codec("lm3h", "codebook", 3, rotate=True, about="Hadamard-rotated, Gaussian Lloyd-Max levels (TurboQuant-style)"),
        Codec("lm2h", "codebook", 2, rotate=True, about="Hadamard-rotated, Gaussian Lloyd-Max levels (TurboQuant-style)"),
    ]
}
