"""Linear layers with a fast path for decode steps: a few rows against float32 or bfloat16 weights.

``DecodeLinear`` is an ``nn.Linear`` (same parameters, same names, same results up to
float rounding). When the input has at most ``MAX_ROWS`` rows (one decode token, or the
windows of a perplexity run), the weights are float32 or bfloat16 on the CPU and the
compiled kernels are available, it calls the skinny matrix product in
``kv/kernels/linear.cpp``, which streams the weights once for all rows at close to memory
bandwidth; in every other case (prefill, float16, CUDA) it is exactly
``nn.Linear.forward``, the reference. ``Llama.use_kernels(False)`` turns the fast path off.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from minillama.kv.kernels import load


MAX_ROWS = 16  # up to here the product is bound by reading the weights, where BLAS is weakest
WEIGHT_CODE = {torch.float32: 0, torch.bfloat16: 2}


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: bool = True) -> torch.Tensor:
    """x (..., in) @ weight (out, in)^T + bias: the skinny-product kernel for a few rows, else F.linear."""
    rows = x.numel() // weight.shape[1]
    if rows > MAX_ROWS and weight.dtype == torch.bfloat16 and weight.device.type == "cpu":
        # Prefill against bf16 weights: CPUs without bf16 instructions run torch's bf16 matrix
        # product 5-10x slower than float32, so widen the weights for the product and round once.
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    if not (kernel and rows <= MAX_ROWS and weight.dtype in WEIGHT_CODE and weight.device.type == "cpu"
            and weight.is_contiguous() and not torch.is_grad_enabled()):
        return F.linear(x, weight, bias)
    lib = load()
    if lib is None:
        return F.linear(x, weight, bias)
    xf = x.reshape(rows, -1).float().contiguous()  # (M, in) float32
    y = torch.empty(rows, weight.shape[0])  # (M, out) float32
    lib.gemm_rows(ctypes.c_void_p(xf.data_ptr()), ctypes.c_void_p(weight.data_ptr()), WEIGHT_CODE[weight.dtype], rows,
                  weight.shape[0], weight.shape[1], ctypes.c_void_p(y.data_ptr()))
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])  # (..., out), rounded once like torch's linear


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
    kernel: bool = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias, self.kernel)
