"""Linear layers: an ``nn.Linear`` that widens bfloat16 products where the CPU is slow at them.

``Linear`` is an ``nn.Linear`` (same parameters, same names, same results up to float
rounding) whose product is ``project``: it widens bfloat16 weights for long inputs on CPUs
without bf16 support (below).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

LONG = 16  # rows above which a bfloat16 product on a CPU without bf16 support is widened to float32


@functools.cache
def cpu_bf16_products() -> bool:
    """Whether torch's CPU matrix products take bfloat16 at speed (oneDNN on AVX-512 BF16, where
    a long bf16 product is faster than widening it to float32)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) @ weight (out, in)^T + bias."""
    rows = x.numel() // weight.shape[1]
    if rows > LONG and weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and not cpu_bf16_products():
        # Prefill against bf16 weights: CPUs without bf16 support (AVX2 only) run torch's bf16
        # matrix product 5-10x slower than float32, so widen the weights for it and round once.
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose product is ``project`` (bf16 widened where the CPU lacks bf16 products)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias)
