"""The cache write by the compiled kernels: the same bytes as kv/write.py's ``Writer``, faster.

``KVCache.append`` (kv/cache.py) takes a ``Writer``: the PyTorch reference converts and codes new
rows with each codec's own functions. ``KernelWriter`` does both steps with native/encode.cpp --
one call for every layer of a step instead of a dozen PyTorch calls -- for the affine codecs
(per-token ``int*``/``int*h`` and KIVI per-channel ``int*c``), the scalar Lloyd-Max codebooks
(``lm*``), frequency-block keys (block by block) and sign-structured vector codes; anything else,
and any input the kernels refuse (non-finite rows), goes to the reference, which names the
problem. tests/test_cache.py holds the bytes equal.
"""

from __future__ import annotations

import torch

from minillama.kv.codecs import Affine, Codebook, Codec, VectorCodebook
from minillama.kv.freq_blocks import FrequencyBlocks
from minillama.kv.quantize import REFINE, all_finite, gaussian_codebook, vector_patterns
from minillama.kv.write import REFERENCE, Writer
from minillama.native import backend, ops
from minillama.native.abi import NotSupported


def native_encoding(codec: Codec) -> type[Codec] | None:
    """Affine, Codebook, FrequencyBlocks or VectorCodebook when native/encode.cpp writes this
    codec's bytes (its class's encode is that family's, not a subclass's own), else None: the
    codec encodes itself."""
    for family in (Affine, Codebook, FrequencyBlocks, VectorCodebook):
        if isinstance(codec, family) and type(codec).encode is family.encode:
            return family
    return None


def writer(device=None) -> Writer:
    """The cache writer the backend asks for on `device`: the kernels' where they run, else the
    reference (kv/write.py)."""
    lib = backend.library(device)
    return KernelWriter(lib) if lib is not None else REFERENCE


class KernelWriter(Writer):
    """The cache write through native/encode.cpp (`lib`: the compiled library)."""

    def __init__(self, lib):
        self.lib = lib

    def storage_form(
        self, codec: Codec, x: torch.Tensor, center: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        if dtype == torch.float16:
            try:
                out = ops.prepare_rows(self.lib, x, codec.rotation, center)  # (L, B, H, n, D)
                backend.ran("storage form")
                return out
            except NotSupported as e:  # non-finite input or an unsupported dtype: the reference names it
                backend.fallback(f"cache write of {codec.name} (rotation/centering): {e}")
        return super().storage_form(codec, x, center, dtype)

    def encode(self, codec: Codec, x: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
        family = native_encoding(codec) if x.dtype == torch.float16 else None
        if family is not None and all_finite(x):
            try:
                parts = self._encode(family, codec, x, group)
                backend.ran("cache encode")
                return parts
            except NotSupported as e:
                backend.fallback(f"cache write of {codec.name}: {e}")
        return super().encode(codec, x, group)  # non-finite input: the reference raises the clear error

    def _encode(self, family: type[Codec], codec, x: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
        lib = self.lib
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
