"""Fast paths for the small operations of a decode step: RMSNorm (with the residual add before
it), RoPE and SiLU x up, each one compiled call (``kv/kernels/decode_ops.cpp``) instead of
3-12 PyTorch calls.

A decode step runs about a thousand such small calls in 30 layers, and on a small CPU each
costs 10-60 microseconds: more time than reading the weights. These are used only for a
few rows (one decode token, or the windows of a perplexity run) in float32 or bfloat16 on
the CPU; everywhere else, and with ``Llama.use_kernels(False)``, the model runs its
PyTorch reference (``model/llama.py``), which a test holds these to.
"""

from __future__ import annotations

import ctypes

import torch

from minillama.kv.kernels import load

MAX_ROWS = 16
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 2}


def usable(x: torch.Tensor) -> bool:
    """A few rows of float32/bfloat16 on the CPU, no autograd, and the kernels built."""
    rows = x.numel() // x.shape[-1]
    return (rows <= MAX_ROWS and x.dtype in DTYPE_CODE and x.device.type == "cpu" and not torch.is_grad_enabled()
            and load() is not None)


def _p(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else None)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, norm(s) * weight) with s = x + h (or x when h is None); x, h (..., N) contiguous."""
    x = x.contiguous()
    n = x.shape[-1]
    s = torch.empty_like(x) if h is not None else x
    out = torch.empty_like(x)
    load().add_rms_norm(_p(x), _p(h.contiguous() if h is not None else None), _p(weight), DTYPE_CODE[x.dtype],
                        x.numel() // n, n, ctypes.c_float(eps), _p(s), _p(out))
    return s, out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in place on x (B, H, 1, D) for one position; cos, sin (1, D) float32. x's heads must be
    D apart and its batch rows evenly spaced (a view of the fused q/k/v output is)."""
    b, h, _, d = x.shape
    assert x.stride(-1) == 1 and x.stride(1) == d
    load().rope_rows(_p(x), DTYPE_CODE[x.dtype], b, h, d, ctypes.c_int64(x.stride(0)), _p(cos), _p(sin))
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from the fused gate|up projection (..., 2I) -> (..., I)."""
    gate_up = gate_up.contiguous()
    i = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], i, dtype=gate_up.dtype)
    load().silu_mul(_p(gate_up), DTYPE_CODE[gate_up.dtype], gate_up.numel() // (2 * i), i, _p(out))
    return out
