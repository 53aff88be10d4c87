"""KV codecs: what is stored per token for one tensor (K or V), and how many bytes it takes.

A codec is one class that owns everything about its format: the named *parts* it stores
(packed codes, scales (fp16, or one byte for ``lm*b``), zeros: each a tensor (B, H, rows, width)), its bits/element
formula, ``encode`` and ``decode`` (arranging calls to the pure quantizers in
``quantize.py`` and ``packing.py``), the checks a model shape must pass, and ``row_kind``:
how the native attention kernels read one stored row (or ``None``: no kernel reads it, and
decode attention takes the reference path). A codec holds no state; the cache
(``cache.py``) owns the buffers its parts are written into, and the ``--kv`` spec
(``spec.py``) picks one per tensor.

A row of a part covers ``tokens_per_row`` tokens: 1 for per-token parts, the group size for
the per-channel scales of KIVI keys.

Adding a codec is one subclass plus ``register()`` (docs/cache.md: "Add your own codec").
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar

import torch

from minillama.errors import UserError
from minillama.kv import packing
from minillama.kv.quantize import (
    check_finite,
    dequantize_affine,
    dequantize_codebook,
    dequantize_ternary,
    dequantize_vectors,
    gaussian_codebook,
    gaussian_vector_codebook,
    hadamard_rotate,
    quantize_affine,
    quantize_codebook,
    quantize_ternary,
    quantize_vectors,
)

# The parts a cache counts as codes (the rest of a codec's parts, scales and zeros, as scales).
CODE_PARTS = ("codes", "values")


class RowKind(IntEnum):
    """How the compiled attention kernels decode one stored row of a codec (the kernels' own
    ``enum RowKind`` in native/minillama.h has the same numbers)."""

    FLOAT = 0  # unquantized rows
    TOKEN = 1  # per-token codes: affine (scale, zero), ternary or codebook (scale only)
    CHANNEL = 2  # KIVI per-channel codes: scale and zero per channel and group of tokens
    VECTOR = 3  # one byte per `dim` channels, the index of a codebook vector, x a scale per group
    BLOCKS = 4  # keys in RoPE frequency blocks, each at its own width (kv/freq_blocks.py)


@dataclass(frozen=True)
class PartSpec:
    name: str
    dtype: torch.dtype
    width: int  # elements per row
    tokens_per_row: int


@dataclass(frozen=True)
class Codec:
    """The base of every codec: per-token rows of packed codes with the parts a subclass names."""

    name: str
    bits: int
    about: str = ""
    rotate: bool = False  # stored Hadamard-rotated (x H); attention runs in the rotated space

    quantized: ClassVar[bool] = True
    row_kind: ClassVar[RowKind | None] = None  # how the native kernels decode a stored row; None: reference only
    channel_groups: ClassVar[bool] = False  # scales per group of G channels of a token: G must divide head_dim

    @property
    def exact_dtype(self) -> torch.dtype:
        """The dtype of the tokens this codec keeps unquantized (residual window, sinks)."""
        return torch.float16

    @property
    def packing(self) -> int | str:
        """How codes are packed (kv/packing.py): a bit width, or "trit"."""
        return self.bits

    @property
    def kernel_bits(self) -> int:
        """The code width as the kernels read it (5 = trits, five per byte)."""
        return self.bits

    def unit(self, group: int) -> int:
        """Tokens that must be quantized together (a whole group for per-channel codecs)."""
        return 1

    def bits_formula(self) -> str:
        raise NotImplementedError

    def validate(self, head_dim: int, group: int) -> None:
        """Raise a UserError when this codec cannot store vectors of head_dim at this group size."""
        if self.channel_groups and head_dim % group:
            raise UserError(f"group={group} does not divide head_dim={head_dim}: pick a divisor of {head_dim}")
        try:
            packing.check_packable(head_dim, self.packing)
        except ValueError as e:
            raise UserError(f"codec {self.name}: {e}") from None

    def parts(self, head_dim: int, group: int) -> list[PartSpec]:
        raise NotImplementedError

    def codes_part(self, head_dim: int) -> PartSpec:
        return PartSpec("codes", torch.uint8, packing.packed_width(head_dim, self.packing), 1)

    def bytes_per_token(self, head_dim: int, group: int) -> float:
        """Stored bytes per token per KV head (scales of per-channel groups spread over G tokens)."""
        return sum(p.width * p.dtype.itemsize / p.tokens_per_row for p in self.parts(head_dim, group))

    def body_bits(self, head_dim: int, group: int) -> float:
        """Bits per element of a quantized row as stored: codes plus scales (and zeros)."""
        return 8 * self.bytes_per_token(head_dim, group) / head_dim

    def kernel_tables(self) -> dict[str, torch.Tensor]:
        """Lookup tables the kernels need besides the parts (a codebook)."""
        return {}

    def kernel_fields(self) -> dict[str, int]:
        """Numbers the kernels need besides the code width and group (RowSource fields by name)."""
        return {}

    @property
    def rotation(self) -> int:
        """How the kernels rotate a query into the storage space: 0 not at all, 1 by H over the
        head, nb > 1 in nb RoPE frequency blocks (quantize.py: block_rotate)."""
        return int(self.rotate)

    def to_space(self, x: torch.Tensor) -> torch.Tensor:
        """Map vectors into the space they are stored in (rotated for Hadamard codecs)."""
        return hadamard_rotate(x) if self.rotate else x

    def from_space(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse of to_space (a Hadamard rotation is its own inverse)."""
        return self.to_space(y)

    def encode(self, x: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
        """x (B, H, T, D), already in storage space -> parts, each (B, H, rows, width)."""
        raise NotImplementedError

    def decode(self, parts: dict[str, torch.Tensor], group: int, head_dim: int) -> torch.Tensor:
        """parts -> float32 (B, H, T, D), still in storage space."""
        raise NotImplementedError

    def unpack(self, parts: dict[str, torch.Tensor], head_dim: int) -> torch.Tensor:
        return packing.unpack(parts["codes"], self.packing, head_dim)  # (B, H, T, D)


@dataclass(frozen=True)
class FloatCodec(Codec):
    """Unquantized rows in a float dtype (fp32, bf16, fp16)."""

    dtype: torch.dtype = torch.float16
    quantized: ClassVar[bool] = False
    row_kind: ClassVar[RowKind] = RowKind.FLOAT

    @property
    def exact_dtype(self) -> torch.dtype:
        return self.dtype

    def bits_formula(self) -> str:
        return f"{self.bits}"

    def validate(self, head_dim: int, group: int) -> None:
        pass

    def parts(self, head_dim: int, group: int) -> list[PartSpec]:
        return [PartSpec("values", self.dtype, head_dim, 1)]

    def encode(self, x, group):
        check_finite(x)
        return {"values": x.to(self.dtype)}

    def decode(self, parts, group, head_dim):
        return parts["values"].float()


@dataclass(frozen=True)
class Affine(Codec):
    """Asymmetric min-max codes (KIVI) with an fp16 scale and zero per group: b + 32/G bits per element.
    ``axis`` says what a group is: G channels of one token, or one channel over G tokens."""

    axis: ClassVar[str] = "token"

    def parts(self, head_dim: int, group: int) -> list[PartSpec]:
        per = (head_dim // group, 1) if self.axis == "token" else (head_dim, group)  # (width, tokens per row)
        return [
            self.codes_part(head_dim),
            PartSpec("scale", torch.float16, *per),
            PartSpec("zero", torch.float16, *per),
        ]

    def encode(self, x, group):
        codes, scale, zero = quantize_affine(x, self.bits, group, self.axis)
        return {"codes": packing.pack(codes, self.bits), "scale": scale, "zero": zero}

    def decode(self, parts, group, head_dim):
        return dequantize_affine(self.unpack(parts, head_dim), parts["scale"], parts["zero"], group, self.axis)


@dataclass(frozen=True)
class TokenAffine(Affine):
    """Per token: groups of G channels."""

    row_kind: ClassVar[RowKind] = RowKind.TOKEN
    channel_groups: ClassVar[bool] = True

    def bits_formula(self) -> str:
        return f"{self.bits} + 32/G  (fp16 scale + zero per G channels)"


@dataclass(frozen=True)
class ChannelAffine(Affine):
    """KIVI per channel: groups of G tokens. Tokens wait in the residual window until a whole
    group can be quantized."""

    axis: ClassVar[str] = "channel"
    row_kind: ClassVar[RowKind] = RowKind.CHANNEL

    def unit(self, group: int) -> int:
        return group

    def bits_formula(self) -> str:
        return f"{self.bits} + 32/G  (fp16 scale + zero per G tokens, per channel)"


@dataclass(frozen=True)
class Scaled(Codec):
    """Per-token codes times one fp16 scale per G channels (no zero): the base of ternary and codebook codecs."""

    row_kind: ClassVar[RowKind] = RowKind.TOKEN
    channel_groups: ClassVar[bool] = True

    def parts(self, head_dim: int, group: int) -> list[PartSpec]:
        return [self.codes_part(head_dim), PartSpec("scale", torch.float16, head_dim // group, 1)]


@dataclass(frozen=True)
class Ternary(Scaled):
    """{-1, 0, +1} x an fp16 scale per G channels (the ternary-weight-network rule), 5 trits per byte."""

    @property
    def packing(self) -> str:
        return "trit"

    @property
    def kernel_bits(self) -> int:
        return 5

    def bits_formula(self) -> str:
        return "8/5 + 16/G  (5 trits per byte, fp16 scale per G channels)"

    def encode(self, x, group):
        codes, scale = quantize_ternary(x, group)
        return {"codes": packing.pack(codes, "trit"), "scale": scale}

    def decode(self, parts, group, head_dim):
        return dequantize_ternary(self.unpack(parts, head_dim), parts["scale"], group)


@dataclass(frozen=True)
class Codebook(Scaled):
    """Gaussian Lloyd-Max levels (TurboQuant-style, after a Hadamard rotation) x a scale per G
    channels: fp16, or with `log_scale` one byte on the grid 2^((u - 128) / 16) (quantize.py)."""

    log_scale: bool = False

    def parts(self, head_dim: int, group: int) -> list[PartSpec]:
        scale = torch.uint8 if self.log_scale else torch.float16
        return [self.codes_part(head_dim), PartSpec("scale", scale, head_dim // group, 1)]

    def bits_formula(self) -> str:
        if self.log_scale:
            return f"{self.bits} + 8/G  (Gaussian Lloyd-Max levels, one-byte log2 scale per G channels)"
        return f"{self.bits} + 16/G  (Gaussian Lloyd-Max levels, fp16 RMS scale per G channels)"

    def kernel_tables(self):
        return {"codebook": gaussian_codebook(self.bits)}

    def encode(self, x, group):
        codes, scale = quantize_codebook(x, self.bits, group, log_scale=self.log_scale)
        return {"codes": packing.pack(codes, self.bits), "scale": scale}

    def decode(self, parts, group, head_dim):
        return dequantize_codebook(self.unpack(parts, head_dim), parts["scale"], self.bits, group)


@dataclass(frozen=True)
class VectorCodebook(Scaled):
    """Vectors of `dim` channels (after a Hadamard rotation) replaced by the nearest of 2**(bits dim)
    vectors, one byte-aligned code per vector, x an fp16 scale per G channels. The book is sign x
    magnitude pattern (quantize.py: gaussian_vector_codebook), which the integer kernel decodes
    in registers."""

    dim: int = 4

    row_kind: ClassVar[RowKind] = RowKind.VECTOR  # AVX-512 VNNI integer values, else the general rows route

    @property
    def packing(self) -> int:
        return 8

    @property
    def kernel_bits(self) -> int:
        return 8  # one byte per code

    def kernel_tables(self):
        return {"codebook": gaussian_vector_codebook(self.dim, self.bits).contiguous()}  # (256, dim)

    def kernel_fields(self):
        # nlevels: the magnitude patterns of the sign-structured book (book[k % nlevels] >= 0)
        return {"vdim": self.dim, "nlevels": (1 << self.bits * self.dim) >> self.dim}

    def validate(self, head_dim: int, group: int) -> None:
        super().validate(head_dim, group)
        if group % self.dim:
            raise UserError(f"codec {self.name} codes {self.dim} channels at a time: group={group} must be a multiple")

    def codes_part(self, head_dim: int) -> PartSpec:
        return PartSpec("codes", torch.uint8, head_dim // self.dim, 1)  # one code of bits x dim = 8 bits per vector

    def bits_formula(self) -> str:
        return (
            f"{self.bits} + 16/G  ({self.dim} channels a byte: a sign x pattern vector, fp16 RMS scale per G channels)"
        )

    def encode(self, x, group):
        codes, scale = quantize_vectors(x, self.dim, self.bits, group)
        return {"codes": codes.to(torch.uint8), "scale": scale}

    def unpack(self, parts, head_dim):
        return parts["codes"]  # (B, H, T, D/dim)

    def decode(self, parts, group, head_dim):
        return dequantize_vectors(parts["codes"], parts["scale"], self.dim, self.bits, group)


CODECS: dict[str, Codec] = {}


def register(codec: Codec) -> Codec:
    """Make a codec usable by name in ``--kv`` specs (and ``minillama kv --list``)."""
    if codec.name in CODECS and CODECS[codec.name] != codec:
        raise ValueError(f"a different codec is already registered as {codec.name!r}")
    CODECS[codec.name] = codec
    return codec


def byte_scale_twin(codec: Codec) -> Codec | None:
    """The registered codec that stores `codec`'s codes with one-byte log scales (lm3h -> lm3hb), or None."""
    if not isinstance(codec, Codebook) or codec.log_scale:
        return None
    same = (codec.bits, codec.rotate)
    return next(
        (c for c in CODECS.values() if isinstance(c, Codebook) and c.log_scale and (c.bits, c.rotate) == same), None
    )


def exact_codec(dtype: torch.dtype) -> Codec:
    """The unquantized codec of a dtype: how sinks and residual tokens are stored."""
    return next(c for c in CODECS.values() if isinstance(c, FloatCodec) and c.dtype == dtype)


for _codec in [
    FloatCodec("fp32", 32, "unquantized float32", dtype=torch.float32),
    FloatCodec("bf16", 16, "unquantized bfloat16", dtype=torch.bfloat16),
    FloatCodec("fp16", 16, "unquantized float16", dtype=torch.float16),
    TokenAffine("int8", 8, "per-token groups of G channels"),
    TokenAffine("int4", 4, "per-token groups of G channels"),
    TokenAffine("int2", 2, "per-token groups of G channels"),
    ChannelAffine("int4c", 4, "KIVI per-channel, groups of G tokens"),
    ChannelAffine("int2c", 2, "KIVI per-channel, groups of G tokens"),
    TokenAffine("int4h", 4, "Hadamard-rotated, then per-token groups", rotate=True),
    TokenAffine("int3h", 3, "Hadamard-rotated, then per-token groups, 8 codes in 3 bytes", rotate=True),
    TokenAffine("int2h", 2, "Hadamard-rotated, then per-token groups", rotate=True),
    Ternary("tern", 2, "ternary {-1,0,+1} x fp16 scale per G channels"),
    Codebook("lm4h", 4, "Hadamard-rotated, Gaussian Lloyd-Max levels (TurboQuant-style)", rotate=True),
    Codebook("lm3h", 3, "Hadamard-rotated, Gaussian Lloyd-Max levels (TurboQuant-style)", rotate=True),
    Codebook("lm2h", 2, "Hadamard-rotated, Gaussian Lloyd-Max levels (TurboQuant-style)", rotate=True),
    Codebook("lm4hb", 4, "lm4h with a one-byte log-coded scale, 2^(k/16)", rotate=True, log_scale=True),
    Codebook("lm3hb", 3, "lm3h with a one-byte log-coded scale, 2^(k/16)", rotate=True, log_scale=True),
    Codebook("lm2hb", 2, "lm2h with a one-byte log-coded scale, 2^(k/16)", rotate=True, log_scale=True),
    VectorCodebook("vq2hs", 2, "Hadamard-rotated, 4 channels a byte: one of 256 sign x pattern vectors", rotate=True),
]:
    register(_codec)


def plain_keys(stored: torch.Tensor, codec: Codec, center: torch.Tensor | None) -> torch.Tensor:
    """Stored keys (B, Hkv, P, D) back in plain space, float32: the center added back (it was taken
    in storage space), then un-rotated."""
    k = stored.float() + center.float() if center is not None else stored.float()
    return codec.from_space(k)
