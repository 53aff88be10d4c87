"""Linear layers with a fast path for decoding one token against bfloat16 weights.

``DecodeLinear`` is an ``nn.Linear`` (same parameters, same names, same results up to
float rounding). When the input is a single row, the weights are bfloat16 on the CPU and
the compiled kernels are available, it calls the matrix-vector kernel in
``kernels/linear.cpp``, which streams the weights at close to memory bandwidth; in every
other case (prefill, batches, float32, CUDA) it is exactly ``nn.Linear.forward``, the
reference. ``Llama.use_kernels(False)`` turns the fast path off.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from minillama.kernels import load


class DecodeLinear(nn.Linear):
    kernel: bool = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight  # (out, in)
        if not (self.kernel and x.numel() == w.shape[1] and w.dtype == torch.bfloat16 and w.device.type == "cpu"
                and w.is_contiguous() and not torch.is_grad_enabled()):
            return super().forward(x)
        lib = load()
        if lib is None:
            return super().forward(x)
        xf = x.reshape(-1).float().contiguous()  # (in,) float32
        y = torch.empty(w.shape[0])  # (out,) float32
        lib.gemv_bf16(ctypes.c_void_p(xf.data_ptr()), ctypes.c_void_p(w.data_ptr()), w.shape[0], w.shape[1],
                      ctypes.c_void_p(y.data_ptr()))
        if self.bias is not None:
            y += self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])  # (..., out), rounded like torch's bf16 linear
