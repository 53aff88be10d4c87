"""A GGUF file's header read in one pass, its tensors left in place (memory-mapped).

The ``gguf`` package's reader makes a numpy array of every piece of every field -- about 100,000
for a 49,152-token vocabulary: seconds and ~160 MB of Python objects before the first weight.
This reads the same header (llama.cpp's gguf.md: magic, version, tensor and key counts, the
key-value pairs, the tensor infos, data aligned to ``general.alignment``) into plain Python
values, and gives each tensor as a numpy view of the mapped file: rows of blocks (uint8) for the
block types, typed arrays for F32/F16. It has the two attributes the loaders use, ``fields``
(name -> value, with ``contents()``) and ``tensors``, as the ``gguf`` package's reader has them
(a test holds the two equal). Anything that does not parse -- truncated, a tensor past the end -- is a ValueError.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
         7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # fmt: skip
TYPED = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


@dataclass
class Field:
    value: object

    def contents(self):
        return self.value


@dataclass
class Tensor:
    name: str
    shape: list[int]  # GGUF's order: the fastest-varying dimension first
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # (rows, row bytes) uint8 for block types; typed, dims reversed (numpy's order) otherwise


class GGUFFile:
    def __init__(self, path: str | Path):
        self.buf = np.memmap(path, dtype=np.uint8, mode="r")
        self.at = 0
        if bytes(self.buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic at the start")
        self.at = 4
        version, n_tensors, n_fields = self.read("<I"), self.read("<Q"), self.read("<Q")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (this reads 2 and 3)")
        self.fields = {}
        for _ in range(n_fields):
            key = self.string()
            self.fields[key] = Field(self.value(self.read("<I")))
        infos = []
        for _ in range(n_tensors):
            name = self.string()
            dims = [self.read("<Q") for _ in range(self.read("<I"))]
            infos.append((name, dims, GGMLQuantizationType(self.read("<I")), self.read("<Q")))
        align = int(self.fields.get("general.alignment", Field(32)).value)
        start = -(-self.at // align) * align
        self.tensors = [self.tensor(name, dims, kind, start + offset) for name, dims, kind, offset in infos]

    def read(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.at + size > len(self.buf):
            raise ValueError("the header ends early: the file is truncated")
        (value,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += size
        return value

    def string(self) -> str:
        n = self.read("<Q")
        if self.at + n > len(self.buf):
            raise ValueError("a string runs past the end: the file is truncated")
        text = bytes(self.buf[self.at : self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return text

    def value(self, kind: int):
        if kind in SCALARS:
            return self.read(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            raise ValueError(f"unknown value type {kind}")
        item, n = self.read("<I"), self.read("<Q")
        if item in NUMPY:  # numbers: one view, no Python object per element
            size = np.dtype(NUMPY[item]).itemsize * n
            if self.at + size > len(self.buf):
                raise ValueError("an array runs past the end: the file is truncated")
            array = np.frombuffer(self.buf, NUMPY[item], n, self.at).tolist()
            self.at += size
            return array
        return [self.value(item) for _ in range(n)]

    def tensor(self, name: str, dims: list[int], kind: GGMLQuantizationType, offset: int) -> Tensor:
        block, size = GGML_QUANT_SIZES[kind]
        cols, rows = dims[0], int(np.prod(dims[1:], dtype=np.int64))
        if cols % block:
            raise ValueError(f"{name}: {cols} columns is not whole {kind.name} blocks")
        nbytes = rows * cols // block * size
        if offset + nbytes > len(self.buf):
            raise ValueError(f"{name} runs past the end of the file: it is truncated or lies")
        raw = self.buf[offset : offset + nbytes]
        data = raw.view(TYPED[kind]).reshape(dims[::-1]) if kind in TYPED else raw.reshape(rows, -1)
        return Tensor(name, dims, kind, data)
