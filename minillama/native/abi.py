"""The C ABI of the kernels (minillama.h) as ctypes sees it: codes, structs and signatures.

Everything Python passes to the compiled library is declared here once and mirrors the
header; ``bind`` attaches the signatures to a freshly built library and refuses it when a
struct's size differs from the compiled one (a header edited without this file).
"""

from __future__ import annotations

import ctypes
from enum import IntEnum

import torch

DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the one table of dtype codes
BLOCK_CODE = {
    "q8_0": 8,
    "q4_0": 9,
    "q4_1": 10,
    "q4_k": 11,
    "q6_k": 12,
}  # weights in blocks (native/dtypes.h: BlockDtype)
INT8_ACTIVATIONS = 256  # | a block code: the product rounds the activations to int8 per block (native/dtypes.h)


class Route(IntEnum):
    """Which kernel reads a part of the cache (minillama.h: enum Route)."""

    FLOAT = 0  # unquantized rows
    TOKEN = 1  # per-token codes, exact float arithmetic
    CHANNEL = 2  # KIVI per-channel codes, exact float arithmetic
    INTEGER = 3  # 2-4-bit affine codes in the integer domain (avx2_int_attention.cpp)
    ROWS = 4  # one decoded row at a time: pre-RoPE keys, vector codes, frequency blocks


STATUS_OK = 0  # minillama.h: MINILLAMA_OK
STATUS = {  # minillama.h: enum MinillamaStatus, the errors
    1: "a dtype the kernel does not take",
    2: "a head_dim the kernel does not support",
    3: "more query heads per KV head than the kernel supports",
    4: "codes (width, group or kind) the kernel does not read",
    5: "sizes that do not fit the kernel",
    6: "values that are not finite",
}

MAX_PARTS = 4  # minillama.h: MINILLAMA_MAX_PARTS (sinks, body, tier, residual)

FEATURES = {
    1: "avx2",
    2: "bmi2",
    4: "avx512",
    8: "avx512_bf16",
    16: "avx512_vnni",
    32: "avx512_vbmi",
    64: "neon",
    128: "dotprod",
    256: "no OpenMP: one thread",
}


class RowSource(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int),
        ("bits", ctypes.c_int),
        ("group", ctypes.c_int),
        ("data", ctypes.c_void_p),
        ("slots", ctypes.c_int),
        ("start", ctypes.c_int),
        ("scale", ctypes.c_void_p),
        ("zero", ctypes.c_void_p),
        ("sslots", ctypes.c_int),
        ("sstart", ctypes.c_int),
        ("codebook", ctypes.c_void_p),
        ("levels", ctypes.c_void_p),
        ("nlevels", ctypes.c_int),
        ("vdim", ctypes.c_int),
        ("center", ctypes.c_void_p),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("pos0", ctypes.c_int),
        ("scale8", ctypes.c_void_p),
    ]


class Part(ctypes.Structure):
    _fields_ = [("route", ctypes.c_int), ("n", ctypes.c_int), ("src", RowSource)]


class LayerPlan(ctypes.Structure):
    _fields_ = [
        ("B", ctypes.c_int),
        ("H", ctypes.c_int),
        ("R", ctypes.c_int),
        ("D", ctypes.c_int),
        ("q", ctypes.c_void_p),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
        ("rotate_k", ctypes.c_int),
        ("rotate_v", ctypes.c_int),
        ("k_center", ctypes.c_void_p),
        ("nk", ctypes.c_int),
        ("nv", ctypes.c_int),
        ("kparts", Part * MAX_PARTS),
        ("vparts", Part * MAX_PARTS),
        ("out", ctypes.c_void_p),
    ]


class LayerStep(ctypes.Structure):
    _fields_ = [
        ("B", ctypes.c_int),
        ("hidden", ctypes.c_int),
        ("Hq", ctypes.c_int),
        ("Hkv", ctypes.c_int),
        ("D", ctypes.c_int),
        ("I", ctypes.c_int),
        ("dtype", ctypes.c_int),
        ("eps", ctypes.c_float),
        *[
            (name, ctypes.c_void_p)
            for name in (
                "w_in",
                "w_post",
                "w_qkv",
                "b_qkv",
                "w_o",
                "b_o",
                "w_gu",
                "b_gu",
                "w_down",
                "b_down",
                "cos",
                "sin",
            )
        ],
        ("pre_rope", ctypes.c_int),
        ("wdtype", ctypes.c_int * 4),  # the weights of w_qkv, w_o, w_gu, w_down: DTYPE_CODE's or BLOCK_CODE's
        ("w_kv", ctypes.c_void_p * 2),  # None, or k and v apart from q (another type); w_qkv then q alone
        ("kv_dtype", ctypes.c_int * 2),
        ("w_up", ctypes.c_void_p),  # None, or up apart from gate (another type); w_gu then gate alone
        ("up_dtype", ctypes.c_int),
        ("x", ctypes.c_void_p),
        ("k_new", ctypes.c_void_p),
        ("v_new", ctypes.c_void_p),
        ("attn", ctypes.POINTER(ctypes.POINTER(LayerPlan))),  # one plan per cache of the batch's rows
        ("nattn", ctypes.c_int),
        ("scratch", ctypes.c_void_p),
        ("timing", ctypes.POINTER(ctypes.c_double)),
    ]


class RingRef(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("slots", ctypes.c_int), ("width", ctypes.c_int)]


class TokenWrite(ctypes.Structure):
    _fields_ = [
        *[(name, ctypes.c_int) for name in ("L", "BH", "D")],
        ("x", ctypes.c_void_p),
        ("layers", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
        ("rotate", ctypes.c_int),
        ("center", ctypes.c_void_p),
        ("to", RingRef),
        *[(name, ctypes.c_int) for name in ("to_slot", "flush", "from_res", "res_first")],
        ("res", RingRef),
        *[(name, ctypes.c_int) for name in ("bits", "group", "axis")],
        ("codes", RingRef),
        ("scale", RingRef),
        ("zero", RingRef),
        ("codes_slot", ctypes.c_int),
        ("scale_slot", ctypes.c_int),
        ("levels", ctypes.c_void_p),
        ("refine", ctypes.c_int),
        ("log_scale", ctypes.c_int),
        ("blocks", ctypes.c_int),
        ("widths", ctypes.c_void_p),
        ("heads", ctypes.c_int),
        ("src_codes", RingRef),
        ("src_scale", RingRef),
        ("src_levels", ctypes.c_void_p),
        ("src_bits", ctypes.c_int),
        ("src_log_scale", ctypes.c_int),
        ("vdim", ctypes.c_int),
        ("patterns", ctypes.c_int),
    ]


class StepEnds(ctypes.Structure):
    _fields_ = [
        *[(name, ctypes.c_void_p) for name in ("embed", "tokens", "cos", "sin", "norm", "head", "product", "out")],
        ("vocab", ctypes.c_int),
        ("eps", ctypes.c_float),
        ("writes", ctypes.POINTER(TokenWrite)),
        ("nwrites", ctypes.c_int),
        ("write_status", ctypes.c_int),
        ("embed_dtype", ctypes.c_int),  # the layers' dtype code, or BLOCK_CODE's
        ("head_dtype", ctypes.c_int),
    ]


# minillama_abi_size(i) is the size of STRUCTS[i]
STRUCTS = [RowSource, Part, LayerPlan, LayerStep, TokenWrite, StepEnds]

_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
SIGNATURES = {  # name: (argument types, return type)
    "attend_layer": ([ctypes.POINTER(LayerPlan)], _I),
    "attend_part": ([_I, _I, _P, ctypes.POINTER(RowSource), _I, _I, _I, _I, _I, _I, _P], _I),
    "route_supported": ([_I, _I, ctypes.POINTER(RowSource), _I, _I], _I),
    "exact_is_faster": ([_I, ctypes.POINTER(RowSource), _I], _I),
    "causal_attention": ([_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _P, _P], _I),
    "gemm_rows": ([_P, _I, _P, _I, _I, _I, _I, _P], _I),
    "dequantize_rows": ([_P, _I, _I, _I, _P, _I], _I),
    "add_rms_norm": ([_P, _P, _P, _I, _I, _I, _F, _P, _P], _I),
    "prepare_rows": ([_P, _I, _I64, _I, _I, _P, _I64, _P], _I64),
    "encode_affine": ([_P, _I64, _I, _I, _I, _I, _I, _P, _P, _P], _I),
    "encode_codebook": ([_P, _I64, _I, _I, _I, _I, _P, _I, _I, _P, _P], _I),
    "encode_vectors": ([_P, _I64, _I, _I, _I, _I, _I, _P, _I, _I, _P, _P], _I),
    "write_tokens": ([ctypes.POINTER(TokenWrite), _I], _I),
    "set_parts": ([ctypes.POINTER(ctypes.POINTER(LayerPlan)), _I, _I, _P, _I], _I),
    "decode_step": ([ctypes.POINTER(LayerStep), _I, ctypes.POINTER(StepEnds)], _I),
    "step_scratch_bytes": ([_I, _I, _I, _I, _I, _I, _I], ctypes.c_int64),
    "minillama_features": ([], _I),
    "minillama_set_threads": ([_I], None),
    "minillama_threads": ([], _I),
    "minillama_abi_size": ([_I], _I),
}


def bind(lib: ctypes.CDLL) -> str:
    """Attach the signatures to `lib`; returns "" or why the library cannot be used."""
    for name, (args, result) in SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is None:
            return f"the kernel library lacks {name}"
        fn.argtypes, fn.restype = args, result
    for i, struct in enumerate(STRUCTS):
        compiled = lib.minillama_abi_size(i)
        if compiled != ctypes.sizeof(struct):
            return f"{struct.__name__} is {compiled} bytes in the library but {ctypes.sizeof(struct)} in native/abi.py"
    return ""


def features(lib: ctypes.CDLL) -> list[str]:
    """The instruction sets the library was compiled with, e.g. ['avx2', 'bmi2', 'avx512', ...]."""
    mask = lib.minillama_features()
    return [name for bit, name in FEATURES.items() if mask & bit]


def check(status: int, what: str) -> None:
    """Raise NotSupported with the reason when a kernel returned a non-zero status."""
    if status:
        raise NotSupported(f"{what}: {STATUS.get(abs(status), f'status {status}')}")


class NotSupported(Exception):
    """A kernel refused its input (nothing was written); the caller takes the reference path."""
