"""Dense-and-sparse outliers (``{codec}o{k}``, e.g. ``lm3hbo1``): a few entries a row kept exact.

KVQuant (Hooper et al. 2024) keeps about 1% of the key entries, the largest, exact beside the
dense code: a key's outlier channels are what stretch its range. Here each row of D (one token of
one KV head) keeps its ``count`` largest entries in the model's own channels (before the
Hadamard rotation a rotated codec applies: rotated, a channel 10x the others would spread over
every coordinate) as an fp16 value and a one-byte channel index; the rest, less them, is coded
by the dense codec ``base``. Decoding adds them back: in storage space that is the sparse row
rotated, so attention, which runs in the rotated space, reads dense rows as for any codec.

Bits per element: the dense codec's plus 24 count / D (a 16-bit value and an 8-bit index an
outlier; D = 64: 0.375 bits an outlier a row). The parts ``oidx`` (count bytes a row) and
``oval`` (count fp16 a row) are rings beside the dense codec's, counted as codes.

The kernels read the dense part through its own route and add the sparse part to each block's
scores (q . s in the model's channels: the query rotated back, since H is its own inverse) and
to the values' partial output (p s H: each outlier's Hadamard row, +-1/sqrt(D)), in
native/outliers.h. The cache write of a decode token takes the PyTorch append: no native
encoder codes outliers (kv/token_write.py declines the group). What it bought: docs/quality.md,
Frontier XXI.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from minillama.errors import UserError
from minillama.kv.codecs import CODECS, Codec, PartSpec
from minillama.kv.quantize import check_finite, outlier_rows, split_outliers
from minillama.native.abi import RowKind


@dataclass(frozen=True)
class Outliers(Codec):
    """``base``'s dense code plus each row's ``count`` largest entries kept exact (see the module)."""

    base: Codec | None = None
    count: int = 1

    @property
    def row_kind(self) -> RowKind | None:  # the dense part's rows; native/outliers.h adds the sparse part
        return self.base.row_kind

    @property
    def exact_dtype(self) -> torch.dtype:
        return self.base.exact_dtype

    @property
    def packing(self) -> int | str:
        return self.base.packing

    @property
    def kernel_bits(self) -> int:
        return self.base.kernel_bits

    @property
    def rotation(self) -> int:
        return self.base.rotation

    def bits_formula(self) -> str:
        return f"{self.base.bits_formula()} + 24*{self.count}/D  ({self.count} exact a row: fp16 value, byte index)"

    def validate(self, head_dim: int, group: int) -> None:
        self.base.validate(head_dim, group)
        if head_dim > 256 or self.count >= head_dim // 2:
            raise UserError(
                f"codec {self.name} keeps {self.count} entries a row exact with a one-byte channel index: "
                f"head_dim {head_dim} needs to be at most 256 and more than twice the count"
            )

    def parts(self, head_dim: int, group: int) -> list[PartSpec]:
        return [
            *self.base.parts(head_dim, group),
            PartSpec("oidx", torch.uint8, self.count, 1),  # channel indices, ascending
            PartSpec("oval", torch.float16, self.count, 1),  # their values, in the model's channels
        ]

    def kernel_tables(self, params):
        return self.base.kernel_tables(params)

    def kernel_fields(self):
        return self.base.kernel_fields()

    def to_space(self, x: torch.Tensor) -> torch.Tensor:
        return self.base.to_space(x)

    def from_space(self, y: torch.Tensor) -> torch.Tensor:
        return self.base.from_space(y)

    def encode(self, x, group, params=None):
        check_finite(x)
        rest, idx, val = split_outliers(x, self.count, self.rotate)  # (B, H, T, D), (B, H, T, count) x 2
        return {**self.base.encode(rest, group, params), "oidx": idx, "oval": val}

    def decode(self, parts, group, head_dim, params=None):
        dense = {name: p for name, p in parts.items() if name not in ("oidx", "oval")}
        sparse = outlier_rows(parts["oidx"], parts["oval"], head_dim, self.rotate)  # (B, H, T, D)
        return self.base.decode(dense, group, head_dim, params) + sparse

    def unpack(self, parts, head_dim):
        return self.base.unpack(parts, head_dim)


_NAME = re.compile(r"^(.+)o([1-9]\d*)$")


def with_outliers(base: Codec, count: int) -> Outliers:
    """``base`` with `count` exact entries a row; a UserError for a codec they cannot sit beside."""
    name = f"{base.name}o{count}"
    if not base.quantized or base.unit(2) != 1 or base.per_sequence or base.rotation > 1 or isinstance(base, Outliers):
        raise UserError(
            f"codec {name}: outliers sit beside a per-token quantized codec (lm3hb, lm2h, int4h, int4, ...), "
            f"not {base.name}"
        )
    return Outliers(
        name, base.bits, f"{base.name} + {count} exact entries a row", rotate=base.rotate, base=base, count=count
    )


@functools.lru_cache(maxsize=64)
def outlier_codec(name: str) -> Outliers | None:
    """The codec a name like ``lm3hbo1`` spells (a registered codec, then o and the count a row),
    None if it spells none."""
    m = _NAME.match(name)
    base = CODECS.get(m.group(1)) if m else None
    return with_outliers(base, int(m.group(2))) if base is not None else None
