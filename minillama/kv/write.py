"""The cache write: new vectors into storage form, and blocks of them into codes.

Two steps of ``layered.LayeredStore.append``, each with the plain PyTorch reference and, when the
backend runs the kernels (native/backend.py), a C++ kernel (``native/encode.cpp``) that writes
identical bytes (a test holds them equal) with one call for every layer of a step instead of
a dozen PyTorch calls:

* ``storage_form``: rotate (Hadamard codecs), subtract the key center (``center=1``) and
  round to the exact dtype the residual keeps (float16 for quantized codecs);
* ``encode``: a block of storage-form vectors into the codec's parts; the kernels cover the
  affine codecs (per-token ``int*``/``int*h`` and KIVI per-channel ``int*c``), the scalar
  Lloyd-Max codebooks (``lm*``) and, block by block, frequency-block keys (``lm{b}f{nb}``);
  every other codec encodes with its own ``Codec.encode``.
"""

from __future__ import annotations

import torch

from minillama.kv.codecs import Affine, Codebook, Codec, VectorCodebook
from minillama.kv.freq_blocks import FrequencyBlocks
from minillama.kv.quantize import REFINE, all_finite, gaussian_codebook, vector_patterns
from minillama.native import backend, ops
from minillama.native.abi import NotSupported


def kernels(device):
    """The compiled cache-write kernels (native/encode.cpp) when the backend runs the kernels, else
    None: the one place a cache write chooses between them and the PyTorch functions, which stay
    as the reference (a test holds the bytes equal)."""
    return backend.library(device)


def storage_form(codec: Codec, x: torch.Tensor, center: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x (L, B, H, n, D) in the model's dtype -> storage form in `dtype`: x H (rotated codecs; by
    frequency block for block codecs), minus `center` (L, B, H, 1, D) when keys are centered."""
    lib = kernels(x.device)
    if lib is not None and dtype == torch.float16:
        try:
            return ops.prepare_rows(lib, x, codec.rotation, center)
        except NotSupported as e:  # non-finite input or an unsupported dtype: the reference below names it
            backend.fallback(f"cache write of {codec.name} (rotation/centering): {e}")
    y = codec.to_space(x)  # (L, B, H, n, D), rotated in the model's dtype
    if center is not None:
        y = y.float() - center.float()
    return y.to(dtype)


def native_encoding(codec: Codec) -> type[Codec] | None:
    """Affine, Codebook, FrequencyBlocks or VectorCodebook when native/encode.cpp writes this
    codec's bytes (its class's encode is that family's, not a subclass's own), else None: the
    codec encodes itself."""
    for family in (Affine, Codebook, FrequencyBlocks, VectorCodebook):
        if isinstance(codec, family) and type(codec).encode is family.encode:
            return family
    return None


def encode(codec: Codec, x: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """x (B, H, T, D) in storage form -> the codec's parts, each (B, H, rows, width)."""
    lib = kernels(x.device)
    family = native_encoding(codec) if x.dtype == torch.float16 else None
    if lib is not None and family is not None and all_finite(x):
        try:
            if family is FrequencyBlocks:  # block by block, each a Lloyd-Max code of its width

                def coder(xb: torch.Tensor, w: int) -> tuple[torch.Tensor, torch.Tensor]:  # code_block's bytes
                    out = ops.encode_codebook(lib, xb.contiguous(), w, xb.shape[-1], gaussian_codebook(w), REFINE, True)
                    return out["codes"], out["scale"]

                return codec.encode_blocks(x, coder)
            if family is VectorCodebook:
                return ops.encode_vectors(
                    lib, x, codec.bits, group, codec.dim, vector_patterns(codec.dim, codec.bits), REFINE
                )
            if family is Codebook:
                return ops.encode_codebook(
                    lib, x, codec.bits, group, gaussian_codebook(codec.bits), REFINE, codec.log_scale
                )
            return ops.encode_affine(
                lib, x, codec.bits, group, codec.axis == "channel", codec.codes_part(x.shape[-1]).width
            )
        except NotSupported as e:
            backend.fallback(f"cache write of {codec.name}: {e}")
    return codec.encode(x, group)  # non-finite input: the reference raises the clear error
