"""KV codecs and the ``--kv`` spec: what is stored per token, and how many bytes it takes.

A codec turns a block of key or value vectors (B, H, T, D) into named *parts* (packed
codes, scales, zeros) and back. It only arranges calls to the pure quantizers in
``quantize.py`` and ``packing.py``; it holds no state. The cache (``cache.py``) owns the
buffers that parts are written into.

Every part is a tensor (B, H, rows, width); a row covers ``tokens_per_row`` tokens
(1 for per-token parts, the group size for the per-channel scales of KIVI keys).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from minillama.kv import packing
from minillama.errors import UserError
from minillama.kv.quantize import (
    check_finite,
    dequantize_affine,
    dequantize_codebook,
    dequantize_ternary,
    hadamard_rotate,
    quantize_affine,
    quantize_codebook,
    quantize_ternary,
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
    kind: str  # "float" | "token" | "channel" | "ternary" | "codebook"
    bits: int
    rotate: bool = False
    about: str = ""

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
        if self.kind == "channel":
            return [codes, PartSpec("scale", torch.float16, head_dim, group), PartSpec("zero", torch.float16, head_dim, group)]
        return [codes, PartSpec("scale", torch.float16, head_dim // group, 1), PartSpec("zero", torch.float16, head_dim // group, 1)]

    def bytes_per_token(self, head_dim: int, group: int) -> float:
        """Stored bytes per token per KV head (scales of per-channel groups spread over G tokens)."""
        return sum(p.width * p.dtype.itemsize / p.tokens_per_row for p in self.parts(head_dim, group))

    def to_space(self, x: torch.Tensor) -> torch.Tensor:
        """Map vectors into the space they are stored in (rotated for Hadamard codecs)."""
        return hadamard_rotate(x) if self.rotate else x

    def encode(self, x: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
        """x (B, H, T, D), already in storage space -> parts, each (B, H, rows, width)."""
        if self.kind == "float":
            check_finite(x)
            return {"values": x.to(self.float_dtype)}
        bits = self.packing()
        if self.kind == "ternary":
            codes, scale = quantize_ternary(x, group)
            return {"codes": packing.pack(codes, bits), "scale": scale}
        if self.kind == "codebook":
            codes, scale = quantize_codebook(x, self.bits, group)
            return {"codes": packing.pack(codes, bits), "scale": scale}
        codes, scale, zero = quantize_affine(x, self.bits, group, "channel" if self.kind == "channel" else "token")
        return {"codes": packing.pack(codes, bits), "scale": scale, "zero": zero}

    def decode(self, parts: dict[str, torch.Tensor], group: int, head_dim: int) -> torch.Tensor:
        """parts -> float32 (B, H, T, D), still in storage space."""
        if self.kind == "float":
            return parts["values"].float()
        codes = packing.unpack(parts["codes"], self.packing(), head_dim)  # (B, H, T, D)
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
        Codec("int2c", "channel", 2, about="KIVI per-channel, groups of G tokens"),
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


@dataclass(frozen=True)
class KVSpec:
    """What the cache stores: a codec for K, one for V, and the window sizes."""

    k: Codec
    v: Codec
    group: int = 32
    residual: int = 0
    sinks: int = 0
    name: str = ""
    center: bool = False  # subtract each sequence's per-channel key mean (see cache.py)

    @property
    def quantized(self) -> bool:
        return self.k.quantized or self.v.quantized

    @property
    def unit(self) -> int:
        """Eviction unit: whole groups whenever either tensor is per-channel."""
        return max(self.k.unit(self.group), self.v.unit(self.group))

    def validate(self, head_dim: int) -> None:
        self.k.validate(head_dim, self.group)
        self.v.validate(head_dim, self.group)

    def __str__(self) -> str:
        if self.name:
            return self.name
        return (f"k={self.k.name},v={self.v.name},group={self.group},residual={self.residual},sinks={self.sinks}"
                + (",center=1" if self.center else ""))


PRESETS: dict[str, str] = {
    "fp32": "k=fp32,v=fp32",
    "bf16": "k=bf16,v=bf16",
    "fp16": "k=fp16,v=fp16",
    "int8": "k=int8,v=int8",
    "kivi4": "k=int4c,v=int4,group=32,residual=32",
    "kivi2": "k=int2c,v=int2,group=32,residual=32",
    "hadv2": "k=int4c,v=int2h,group=32,residual=32",
    "ternary": "k=int4c,v=tern,group=32,residual=32",
    # Frontier presets (see the README's ablation): exact attention sinks, rotated keys,
    # 3-bit rotated values, Lloyd-Max codebooks.
    "kivi4s": "k=int4c,v=int4,group=32,residual=32,sinks=4",
    "hadv2s": "k=int4c,v=int2h,group=32,residual=32,sinks=4",
    "k4v3h": "k=int4h,v=int3h,group=64,residual=32,sinks=4",
    "k4v3lm": "k=int4h,v=lm3h,group=64,residual=32,sinks=4",
    "k3v2lm": "k=lm3h,v=lm2h,group=64,residual=8,sinks=4",
    # Centered keys (center=1): the winners of the second round.
    "k4v3hc": "k=int4h,v=int3h,group=64,residual=32,sinks=4,center=1",
    "k4v3lmc": "k=lm4h,v=lm3h,group=64,residual=8,sinks=4,center=1",
    "k4v4lmc": "k=lm4h,v=lm4h,group=64,residual=8,sinks=4,center=1",
}

PRESET_NOTES: dict[str, str] = {
    "hadv2": "KIVI int4 keys + Hadamard-rotated 2-bit values (the method minillama reproduces)",
    "kivi4": "KIVI: per-channel int4 keys, per-token int4 values",
    "kivi2": "KIVI: per-channel int2 keys, per-token int2 values",
    "ternary": "KIVI int4 keys + ternary values",
    "kivi4s": "kivi4 + the first 4 tokens kept exact (attention sinks)",
    "hadv2s": "hadv2 + the first 4 tokens kept exact (attention sinks)",
    "k4v3h": "Hadamard int4 keys, Hadamard int3 values, group 64, 4 sinks",
    "k4v3lm": "Hadamard int4 keys, Hadamard Lloyd-Max 3-bit values, group 64, 4 sinks",
    "k3v2lm": "Hadamard Lloyd-Max 3-bit keys and 2-bit values, group 64, residual 8, 4 sinks",
    "k4v3hc": "k4v3h with centered keys (per-sequence channel mean subtracted)",
    "k4v3lmc": "Lloyd-Max 4-bit keys (centered) and 3-bit values, group 64, residual 8, 4 sinks",
    "k4v4lmc": "Lloyd-Max 4-bit keys (centered) and 4-bit values, group 64, residual 8, 4 sinks",
}

_FIELD = re.compile(r"^(k|v|group|residual|sinks|center)=(.+)$")


def _choices() -> str:
    return f"presets: {', '.join(PRESETS)}; codecs: {', '.join(CODECS)}"


def parse_kv(text: str) -> KVSpec:
    """Parse a preset name or ``k=CODEC,v=CODEC[,group=G][,residual=R][,sinks=S][,center=0|1]``."""
    text = text.strip()
    if text in PRESETS:
        spec = parse_kv(PRESETS[text])
        return KVSpec(spec.k, spec.v, spec.group, spec.residual, spec.sinks, name=text, center=spec.center)
    if "=" not in text:
        raise UserError(f"unknown --kv preset {text!r} ({_choices()})")
    fields: dict[str, str] = {}
    for item in text.split(","):
        m = _FIELD.match(item.strip())
        if not m:
            raise UserError(f"malformed --kv item {item!r}: expected k=CODEC,v=CODEC[,group=G][,residual=R][,sinks=S][,center=0|1] ({_choices()})")
        fields[m.group(1)] = m.group(2).strip()
    if "k" not in fields or "v" not in fields:
        raise UserError(f"--kv {text!r} must name both k= and v= codecs ({_choices()})")
    for key in ("k", "v"):
        if fields[key] not in CODECS:
            raise UserError(f"unknown codec {fields[key]!r} for {key}= ({_choices()})")
    k, v = CODECS[fields["k"]], CODECS[fields["v"]]
    nums = {}
    for key in ("group", "residual", "sinks", "center"):
        if key in fields:
            try:
                nums[key] = int(fields[key])
            except ValueError:
                raise UserError(f"--kv {key}={fields[key]!r} is not a whole number") from None
            if nums[key] < 0:
                raise UserError(f"--kv {key}={nums[key]} must not be negative")
    group = nums.get("group", 32)
    if group < 1:
        raise UserError("--kv group must be at least 1")
    quantized = k.quantized or v.quantized
    residual = nums.get("residual", 32 if quantized else 0)
    if nums.get("center", 0) > 1:
        raise UserError("--kv center must be 0 or 1")
    return KVSpec(k, v, group, residual, nums.get("sinks", 0), name=text if text not in PRESETS.values() else "",
                  center=bool(nums.get("center", 0)))
