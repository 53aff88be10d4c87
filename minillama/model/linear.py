"""Linear layers with a fast path for decode steps: a few rows against float32 or bfloat16 weights.

``DecodeLinear`` is an ``nn.Linear`` (same parameters, same names, same results up to
float rounding). When the backend runs the kernels (native/backend.py) and the input has at
most ``MAX_ROWS`` rows (one decode token, or the windows of a perplexity run), the product
goes to the skinny matrix kernel (``native/linear.cpp``), which streams the weights once for
all rows at close to memory bandwidth; in every other case it is ``F.linear``, the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minillama.native import backend, ops
from minillama.native.abi import NotSupported

MAX_ROWS = 16  # up to here the product is bound by reading the weights, where BLAS is weakest


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) @ weight (out, in)^T + bias: the skinny-product kernel for a few rows, else F.linear."""
    rows = x.numel() // weight.shape[1]
    if rows > MAX_ROWS and weight.dtype == torch.bfloat16 and weight.device.type == "cpu":
        # Prefill against bf16 weights: CPUs without bf16 instructions run torch's bf16 matrix
        # product 5-10x slower than float32, so widen the weights for the product and round once.
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    lib = backend.library(weight.device)
    if lib is not None and rows <= MAX_ROWS and not torch.is_grad_enabled():
        try:
            y = ops.gemm_rows(lib, x.reshape(rows, -1), weight)  # (M, out) float32
        except NotSupported as e:  # float16 weights, a strided view: the reference, recorded
            backend.fallback(f"projection {tuple(weight.shape)} {weight.dtype}: {e}")
            return F.linear(x, weight, bias)
        if bias is not None:
            y += bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])  # (..., out), rounded once like torch's linear
    return F.linear(x, weight, bias)


def concat_rows(layers: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One (sum of outs, in) weight (and bias) for several projections of the same input.

    The layers' parameters are replaced by views into it, so nothing is stored twice and
    the layers still work (and load, and save) on their own.
    """
    weight = torch.cat([m.weight.detach() for m in layers])  # (sum out, in)
    bias = torch.cat([m.bias.detach() for m in layers]) if layers[0].bias is not None else None
    row = 0
    for m in layers:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[row : row + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[row : row + n], requires_grad=False)
        row += n
    return weight, bias


class DecodeLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias)
