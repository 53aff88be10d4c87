"""The kernels as functions of tensors: pointers and sizes in, tensors out.

Each function takes the library from ``backend.library()`` (the caller has decided to run
the kernels), checks the layout it needs and raises ``NotSupported`` with the reason when the
kernel refuses its input; nothing is written then and the caller takes the reference.
Which PyTorch code each one replaces is said in its docstring; tests hold the two equal.
"""

from __future__ import annotations

import ctypes

import torch

from minillama.native.abi import (
    BLOCK_CODE,
    DTYPE_CODE,
    INT8_ACTIVATIONS,
    LayerPlan,
    NotSupported,
    RowSource,
    StepEnds,
    check,
)


def _p(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else None)


def _code(t: torch.Tensor, what: str, allowed=(torch.float32, torch.bfloat16)) -> int:
    if t.dtype not in allowed:
        raise NotSupported(f"{what}: {t.dtype} is not one of {', '.join(map(str, allowed))}")
    return DTYPE_CODE[t.dtype]


def gemm_rows(lib, x: torch.Tensor, weight: torch.Tensor, kind: str | None = None, int8: bool = False) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T -> (M, N) float32 (``F.linear`` without bias, before rounding), x
    float32 or bfloat16, any M: the weights stream once per 16 rows (native/linear.cpp). weight
    float32 or bfloat16, or with `kind` rows of blocks (N, K / 32 * bytes) uint8 whose product is
    ``x @ weights.blocks.dequantize(weight, kind).T``; with `int8` too, x is first rounded to int8
    per block of 32 (``weights.blocks.round_activations(x)``)."""
    code = BLOCK_CODE[kind] | (INT8_ACTIVATIONS if int8 else 0) if kind else _code(weight, "gemm_rows")
    if not weight.is_contiguous():
        raise NotSupported("gemm_rows: weights must be contiguous")
    x = x.contiguous() if x.dtype in (torch.float32, torch.bfloat16) else x.float().contiguous()
    y = torch.empty(x.shape[0], weight.shape[0])  # (M, N)
    check(lib.gemm_rows(_p(x), DTYPE_CODE[x.dtype], _p(weight), code, x.shape[0], weight.shape[0], x.shape[1], _p(y)),
          "gemm_rows")  # fmt: skip
    return y


def dequantize_rows(lib, blocks: torch.Tensor, kind: str, n_in: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of blocks (N, n_in / 32 * bytes) -> (N, n_in) in float32 or bfloat16: bit for bit
    ``weights.blocks.dequantize(blocks, kind).to(dtype)`` (native/linear.cpp)."""
    code = _code(torch.empty(0, dtype=dtype), "dequantize_rows")
    out = torch.empty(blocks.shape[0], n_in, dtype=dtype)  # (N, n_in)
    check(lib.dequantize_rows(_p(blocks), BLOCK_CODE[kind], blocks.shape[0], n_in, _p(out), code), "dequantize_rows")
    return out


def causal_attention(lib, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q (B, Hq, T, D), k and v (B, Hkv, P+T, D), float32 -> (B, Hq, T, D) float32: query t attends
    keys 0 .. P+t, i.e. ``F.scaled_dot_product_attention`` with the bottom-right causal mask and
    ``enable_gqa`` (native/prefill_attention.cpp). Any strides with contiguous channels; the
    output is laid out (B, T, Hq, D) in memory, as the output projection reads it."""
    for t, what in ((q, "q"), (k, "k"), (v, "v")):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise NotSupported(f"causal_attention: {what} is {t.dtype} on {t.device.type}, not float32 on the CPU")
    b, hq, t, d = q.shape
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.empty(b, t, hq, d).transpose(1, 2)  # (B, Hq, T, D) viewing (B, T, Hq, D) memory
    (qs, ks, vs, os_) = ((ctypes.c_int64 * 3)(*x.stride()[:3]) for x in (q, k, v, out))
    status = lib.causal_attention(_p(q), qs, _p(k), ks, _p(v), vs, b, hq, k.shape[1], t, k.shape[2], d, _p(out), os_)
    check(status, "causal_attention")
    return out


def silu_mul(lib, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from a fused (M, 2I) gate|up row block, float32 or bfloat16, rounded where
    model/llama.py's MLP rounds (the step's own SiLU, native/decode_ops.cpp)."""
    code = _code(gate_up, "silu_mul")
    gate_up = gate_up.contiguous()
    m, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(m, i, dtype=gate_up.dtype)
    check(lib.silu_mul(_p(gate_up), code, m, i, _p(out)), "silu_mul")
    return out


def add_rms_norm(
    lib, x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, RMSNorm(s) * weight) with s = x + h (or x when h is None); x, h (..., N) float32 or bfloat16,
    rounded where model/llama.py's RMSNorm and residual add round."""
    code = _code(x, "add_rms_norm")
    x = x.contiguous()
    n = x.shape[-1]
    s = torch.empty_like(x) if h is not None else x
    out = torch.empty_like(x)
    check(
        lib.add_rms_norm(
            _p(x),
            _p(h.contiguous() if h is not None else None),
            _p(weight),
            code,
            x.numel() // n,
            n,
            eps,
            _p(s),
            _p(out),
        ),
        "add_rms_norm",
    )
    return s, out


def prepare_rows(lib, x: torch.Tensor, rotate: int, center: torch.Tensor | None) -> torch.Tensor:
    """x (..., n, D) -> float16 (..., n, D): x H (rotate 1), or in rotate > 1 frequency blocks
    (kv/quantize.py: block_rotate), minus center (..., 1, D) broadcast over n. Raises
    NotSupported for non-finite results too: the reference refuses them with a clear error."""
    code = _code(x, "prepare_rows", tuple(DTYPE_CODE))
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float16)
    c = center.to(torch.float16).contiguous() if center is not None else None
    bad = lib.prepare_rows(_p(x), code, x.numel() // x.shape[-1], x.shape[-1], int(rotate), _p(c), x.shape[-2], _p(out))
    check(min(int(bad), 0), "prepare_rows")
    if bad:
        raise NotSupported("prepare_rows: non-finite values")
    return out


def encode_affine(
    lib, x: torch.Tensor, bits: int, group: int, per_channel: bool, packed_width: int
) -> dict[str, torch.Tensor]:
    """x (B, H, T, D) float16 -> codes (B, H, T, packed_width) uint8, scale and zero float16:
    kv/quantize.py's quantize_affine then kv/packing.py's pack, byte for byte."""
    if x.dtype != torch.float16:
        raise NotSupported("encode_affine: float16 input only")
    x = x.contiguous()
    b, h, t, d = x.shape
    codes = torch.empty(b, h, t, packed_width, dtype=torch.uint8)
    rows = (t // group, d) if per_channel else (t, d // group)
    scale, zero = torch.empty(b, h, *rows, dtype=torch.float16), torch.empty(b, h, *rows, dtype=torch.float16)
    check(
        lib.encode_affine(_p(x), b * h, t, d, bits, group, int(per_channel), _p(codes), _p(scale), _p(zero)),
        "encode_affine",
    )
    return {"codes": codes, "scale": scale, "zero": zero}


def encode_codebook(
    lib, x: torch.Tensor, bits: int, group: int, levels: torch.Tensor, refine: int, log_scale: bool = False
) -> dict[str, torch.Tensor]:
    """x (B, H, T, D) float16 -> codes (B, H, T, D bits / 8) uint8 and scale (B, H, T, D / group)
    float16, or uint8 one-byte log scales with ``log_scale``: kv/quantize.py's quantize_codebook
    (levels float32, ascending) then kv/packing.py's pack, byte for byte."""
    if x.dtype != torch.float16 or levels.dtype != torch.float32:
        raise NotSupported("encode_codebook: float16 input and float32 levels only")
    x, levels = x.contiguous(), levels.contiguous()
    b, h, t, d = x.shape
    codes = torch.empty(b, h, t, d * bits // 8, dtype=torch.uint8)
    scale = torch.empty(b, h, t, d // group, dtype=torch.uint8 if log_scale else torch.float16)
    check(
        lib.encode_codebook(_p(x), b * h, t, d, bits, group, _p(levels), refine, int(log_scale), _p(codes), _p(scale)),
        "encode_codebook",
    )
    return {"codes": codes, "scale": scale}


def encode_vectors(
    lib, x: torch.Tensor, bits: int, group: int, dim: int, patterns: torch.Tensor, refine: int
) -> dict[str, torch.Tensor]:
    """x (B, H, T, D) float16 -> codes (B, H, T, D / dim) uint8 and scale (B, H, T, D / group)
    float16: kv/quantize.py's quantize_vectors with a sign-structured book (patterns (P, dim)
    float32, its non-negative vectors), byte for byte."""
    if x.dtype != torch.float16 or patterns.dtype != torch.float32:
        raise NotSupported("encode_vectors: float16 input and float32 patterns only")
    x, patterns = x.contiguous(), patterns.contiguous()
    b, h, t, d = x.shape
    codes = torch.empty(b, h, t, d // dim, dtype=torch.uint8)
    scale = torch.empty(b, h, t, d // group, dtype=torch.float16)
    status = lib.encode_vectors(
        _p(x), b * h, t, d, bits, group, dim, _p(patterns), patterns.shape[0], refine, _p(codes), _p(scale)
    )
    check(status, "encode_vectors")
    return {"codes": codes, "scale": scale}


def route_supported(lib, route: int, values: bool, src: RowSource, r: int, d: int) -> int:
    """0 when the `route` kernel reads `src` (as values, or as keys) for r query heads per KV head
    of size d, else a status (abi.STATUS says what it means)."""
    return lib.route_supported(route, int(values), ctypes.byref(src), r, d)


def exact_is_faster(lib, values: bool, src: RowSource, d: int) -> bool:
    """Whether this build's exact kernels read `src` faster than its integer route would (no VNNI
    kernel for these rows, and a SIMD exact one: AVX2 CPUs, codebooks)."""
    return bool(lib.exact_is_faster(int(values), ctypes.byref(src), d))


def attend_layer(lib, plan: LayerPlan) -> None:
    """One layer's decode attention as described by `plan` (kv/fused_attention.py builds it)."""
    check(lib.attend_layer(ctypes.byref(plan)), "attend_layer")


def attend_part(
    lib,
    values: bool,
    route: int,
    x: torch.Tensor,
    column: int,
    src: RowSource,
    r: int,
    d: int,
    n: int,
    ld: int,
    out: torch.Tensor,
) -> None:
    """One part through its kernel alone (tests): see minillama.h."""
    b, h = x.shape[:2]
    x_ptr = x.data_ptr() + (4 * column if values else 0)
    out_ptr = out.data_ptr() + (0 if values else 4 * column)
    check(
        lib.attend_part(
            int(values), route, ctypes.c_void_p(x_ptr), ctypes.byref(src), b, h, r, d, n, ld, ctypes.c_void_p(out_ptr)
        ),
        "attend_part",
    )


def set_parts(lib, plans: ctypes.Array, values: bool, live: ctypes.Array, nparts: int) -> None:
    """Every plan in `plans` (an array of LayerPlan pointers) gets the first `nparts` parts of keys
    or values counted and placed as `live` says: (n, start, scale start, first position) per part."""
    check(lib.set_parts(plans, len(plans), int(values), live, nparts), "set_parts")


def write_tokens(lib, writes: ctypes.Array) -> None:
    """One decode token into the rings of every group of layers, each as its write describes it
    (a TokenWrite array, kv/token_write.py builds it); all or nothing: NotSupported, with nothing
    written, for non-finite values or codes the kernel does not write."""
    check(lib.write_tokens(writes, len(writes)), "write_tokens")


def decode_step(lib, steps: ctypes.Array, ends: StepEnds) -> None:
    """A whole decode step as model/step.py describes it: the embedding rows, every layer in order
    (the LayerStep array), the final norm and the LM head (StepEnds)."""
    check(lib.decode_step(steps, len(steps), ctypes.byref(ends)), "decode_step")
