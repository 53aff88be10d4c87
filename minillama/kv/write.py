"""The cache write: new vectors into storage form, and blocks of them into codes.

Two steps of ``store.append_layers``, each with the plain PyTorch reference and, on the
CPU, a C++ kernel (``kernels/encode.cpp``) that writes identical bytes (a test holds them
equal) with one call for every layer of a step instead of a dozen PyTorch calls:

* ``storage_form``: rotate (Hadamard codecs), subtract the key center (``center=1``) and
  round to the exact dtype the residual keeps (float16 for quantized codecs);
* ``encode``: a block of storage-form vectors into the codec's parts; the kernel covers the
  affine codecs (per-token ``int*``/``int*h`` and KIVI per-channel ``int*c``), the others
  always take the reference.
"""

from __future__ import annotations

import ctypes

import torch

from minillama.kv import packing
from minillama.kv.codecs import Codec
from minillama.kv.kernels import load

DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _lib(kernel: bool, x: torch.Tensor):
    return load() if kernel and x.device.type == "cpu" and x.dtype in DTYPE_CODE else None


def storage_form(codec: Codec, x: torch.Tensor, center: torch.Tensor | None, dtype: torch.dtype,
                 kernel: bool = True) -> torch.Tensor:
    """x (L, B, H, n, D) in the model's dtype -> storage form in `dtype`: x H (rotated codecs),
    minus `center` (L, B, H, 1, D) when keys are centered."""
    lib = _lib(kernel, x)
    if lib is not None and dtype == torch.float16:
        x = x.contiguous()
        out = torch.empty(x.shape, dtype=torch.float16)
        c = center.to(torch.float16).contiguous() if center is not None else None
        bad = lib.prepare_rows(ctypes.c_void_p(x.data_ptr()), DTYPE_CODE[x.dtype], x.numel() // x.shape[-1],
                               x.shape[-1], int(codec.rotate), ctypes.c_void_p(c.data_ptr() if c is not None else None),
                               x.shape[-2], ctypes.c_void_p(out.data_ptr()))
        if not bad:
            return out
    y = codec.to_space(x)  # (L, B, H, n, D), rotated in the model's dtype
    if center is not None:
        y = y.float() - center.float()
    return y.to(dtype)


def encode(codec: Codec, x: torch.Tensor, group: int, params: dict | None = None,
           kernel: bool = True) -> dict[str, torch.Tensor]:
    """x (B, H, T, D) in storage form -> the codec's parts, each (B, H, rows, width)."""
    lib = _lib(kernel, x)
    if (lib is None or x.dtype != torch.float16 or codec.kind not in ("token", "channel")
            or not bool(torch.isfinite(x).all())):  # non-finite input: the reference raises the clear error
        return codec.encode(x, group, params)
    x = x.contiguous()
    b, h, t, d = x.shape
    codes = torch.empty(b, h, t, packing.packed_width(d, codec.bits), dtype=torch.uint8)
    rows = (t, d // group) if codec.kind == "token" else (t // group, d)
    scale, zero = torch.empty(b, h, *rows, dtype=torch.float16), torch.empty(b, h, *rows, dtype=torch.float16)
    lib.encode_affine(ctypes.c_void_p(x.data_ptr()), b * h, t, d, codec.bits, group, int(codec.kind == "channel"),
                      ctypes.c_void_p(codes.data_ptr()), ctypes.c_void_p(scale.data_ptr()), ctypes.c_void_p(zero.data_ptr()))
    return {"codes": codes, "scale": scale, "zero": zero}
