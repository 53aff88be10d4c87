"""The decode step on the kernels backend: one native call per layer (native/step.cpp).

``model/llama.py`` is the specification: for one token per sequence its ``DecoderLayer`` makes
about twenty PyTorch calls and four kernel calls, each costing microseconds of dispatch on a
small CPU. ``NativeStep`` describes each layer to the C++ step once (weights, norms, biases:
pointers that never change) and per step adds what does: the hidden state, the RoPE angles of
the position and the attention plan of the layer's cache (kv/fused_attention.py). The new keys
and values of every layer are then appended to the cache in one ``cache.append``, as the
reference does. Tests hold the logits of both paths equal (tests/test_step.py).
"""

from __future__ import annotations

import ctypes

import torch

from minillama.kv.fused_attention import layer_plan
from minillama.kv.interface import Cache
from minillama.native import ops
from minillama.native.abi import DTYPE_CODE, LayerPlan, LayerStep


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


class NativeStep:
    """One model's layers described to the C++ decode step, for `batch` sequences in `dtype`."""

    def __init__(self, model, lib, batch: int):
        cfg = model.config
        self.lib, self.batch, self.dtype = lib, batch, model.dtype
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.n_kv_heads, cfg.head_dim
        n = cfg.num_hidden_layers
        self.new_k = torch.empty(n, batch, self.hkv, 1, self.d, dtype=self.dtype)  # (L, B, Hkv, 1, D)
        self.new_v = torch.empty_like(self.new_k)
        size = lib.step_scratch_bytes(
            batch, cfg.hidden_size, self.hq, self.hkv, self.d, cfg.intermediate_size, DTYPE_CODE[self.dtype]
        )
        self.scratch = torch.empty(size, dtype=torch.uint8)
        self.weights: list[torch.Tensor] = []  # every tensor a LayerStep points at, kept alive with it
        self.steps = []
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            (w_qkv, b_qkv), (w_gu, b_gu) = attn.qkv, mlp.gate_up
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            self.weights += [t for t in (*norms, w_qkv, b_qkv, attn.o_proj.weight, attn.o_proj.bias) if t is not None]
            self.weights += [t for t in (w_gu, b_gu, mlp.down_proj.weight, mlp.down_proj.bias) if t is not None]
            self.steps.append(
                LayerStep(
                    B=batch,
                    hidden=cfg.hidden_size,
                    Hq=self.hq,
                    Hkv=self.hkv,
                    D=self.d,
                    I=cfg.intermediate_size,
                    dtype=DTYPE_CODE[self.dtype],
                    eps=layer.input_layernorm.eps,
                    w_in=_ptr(layer.input_layernorm.weight),
                    w_post=_ptr(layer.post_attention_layernorm.weight),
                    w_qkv=_ptr(w_qkv),
                    b_qkv=_ptr(b_qkv),
                    w_o=_ptr(attn.o_proj.weight),
                    b_o=_ptr(attn.o_proj.bias),
                    w_gu=_ptr(w_gu),
                    b_gu=_ptr(b_gu),
                    w_down=_ptr(mlp.down_proj.weight),
                    b_down=_ptr(mlp.down_proj.bias),
                    k_new=_ptr(self.new_k[i]),
                    v_new=_ptr(self.new_v[i]),
                    scratch=_ptr(self.scratch),
                )
            )

    def time_phases(self, timing: torch.Tensor | None) -> None:
        """Profiling: every layer call adds the wall seconds of its projections, attention and the
        rest to timing (3,) float64 (bench/step_profile.py); None stops it."""
        ptr = ctypes.cast(timing.data_ptr(), ctypes.POINTER(ctypes.c_double)) if timing is not None else None
        self._timing = timing  # kept alive while the kernels write to it
        for step in self.steps:
            step.timing = ptr

    def run(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Cache | None, rotary=None
    ) -> torch.Tensor:
        """x (B, 1, hidden) after the embedding -> the last layer's output (B, 1, hidden); the cache
        gets every layer's new keys and values. NotSupported before anything runs when a layer's
        cache has a part no kernel reads."""
        keep: list = []
        pre = cache is not None and cache.pre_rope
        views = [cache.layer(i) for i in range(len(self.steps))] if cache is not None else [None] * len(self.steps)
        rope = rotary.halves if pre else None
        plans = [
            layer_plan(self.lib, view, self.hq // self.hkv, self.d, rope, keep) if view is not None else LayerPlan()
            for view in views
        ]  # every plan before any layer runs: all or nothing
        x = x.contiguous().clone()  # (B, 1, hidden), updated in place layer by layer
        cos, sin = cos.float().contiguous(), sin.float().contiguous()  # (1, D) each
        for step, plan in zip(self.steps, plans):
            step.x, step.cos, step.sin, step.pre_rope = x.data_ptr(), cos.data_ptr(), sin.data_ptr(), int(pre)
            step.attn = ctypes.pointer(plan)
            ops.decode_layer(self.lib, step)
        if cache is not None:
            for view in views:
                view.count_kernel_read()
            # fresh tensors: a cache may keep what it is given, and the step reuses its buffers
            new_k, new_v = self.new_k.clone(), self.new_v.clone()  # (L, B, Hkv, 1, D) each
            cache.append(list(zip(new_k, new_v)))  # the one place the cache grows
        return x
