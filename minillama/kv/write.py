"""The cache write's two conversions: new vectors into storage form, and blocks of them into codes.

``layered.LayeredStore.append`` decides where every token goes; a ``Writer`` does the arithmetic:

* ``storage_form``: rotate (Hadamard codecs), subtract the key center (``center=1``) and round
  to the exact dtype the residual keeps (float16 for quantized codecs);
* ``encode``: a block of storage-form vectors into the codec's parts (``Codec.encode``).

``Writer`` is the plain PyTorch write, the specification. The compiled kernels' writer
(native/write.py) writes the same bytes (a test holds them equal) and is handed to
``KVCache.append`` by the fast path; the cache itself never asks which one runs.
"""

from __future__ import annotations

import torch

from minillama.kv.codecs import Codec


class Writer:
    """The reference cache write: each codec's own PyTorch functions."""

    def storage_form(
        self, codec: Codec, x: torch.Tensor, center: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """x (L, B, H, n, D) in the model's dtype -> storage form in `dtype`: x H (rotated codecs; by
        frequency block for block codecs), minus `center` (L, B, H, 1, D) when keys are centered."""
        y = codec.to_space(x)  # (L, B, H, n, D), rotated in the model's dtype
        if center is not None:
            y = y.float() - center.float()
        return y.to(dtype)

    def encode(self, codec: Codec, x: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
        """x (B, H, T, D) in storage form -> the codec's parts, each (B, H, rows, width)."""
        return codec.encode(x, group)


REFERENCE = Writer()
