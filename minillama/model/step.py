"""The decode step on the kernels backend: every layer in one native call (native/step.cpp).

``model/llama.py`` is the specification, plain PyTorch: for one token per sequence its
``DecoderLayer`` makes about twenty PyTorch calls, each costing microseconds of dispatch on a
small CPU. This module is the other path and the one place that chooses between them
(``decode``): on the kernels backend a step of one token per sequence runs here, whole or not at
all; anything else (prefill, the reference backend, a cache no kernel reads -- the reason is
recorded, native/backend.py: fallback) runs the PyTorch layers.

``NativeStep`` describes each layer to the C++ step once (weights, norms, biases: pointers that
never change) and per step adds what does: the hidden state, the RoPE angles of the position
and the attention plans of the layer's caches (kv/fused_attention.py). The new keys and values
of every layer are then appended to the cache in one call, as the reference does. Tests hold
the logits of both paths equal (tests/test_step.py).
"""

from __future__ import annotations

import ctypes

import torch

from minillama.kv.cache import KVCache
from minillama.kv.fused_attention import layer_plan
from minillama.kv.group import CacheGroup
from minillama.kv.interface import Cache
from minillama.model.rope import rope_tables
from minillama.native import backend, ops
from minillama.native.abi import DTYPE_CODE, LayerPlan, LayerStep, NotSupported


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
        # The step's own buffers, at fixed addresses the layers point at: the residual stream and
        # this token's RoPE angles, copied in at each step (normal tensors even when made under
        # inference mode, so that a step outside it may write them too).
        with torch.inference_mode(False):
            self.x = torch.empty(batch, 1, cfg.hidden_size, dtype=self.dtype)  # (B, 1, hidden)
            self.cos = torch.empty(1, self.d)  # (1, D) float32
            self.sin = torch.empty(1, self.d)
        self.norm, self.eps = model.model.norm.weight, model.model.norm.eps  # the final norm
        self.steps = (LayerStep * n)()  # one contiguous array: the whole step is one native call
        self.pre_rope = False
        self.plans: list[list[LayerPlan]] = [[] for _ in range(n)]  # the plans each layer points at now
        self.plan_ids: list[list[int]] = [[] for _ in range(n)]
        self.pointers: list = [None] * n  # each layer's array of plan pointers
        self.no_cache = [[LayerPlan(B=batch)] for _ in range(n)]  # the plans of a step without a cache: no parts
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            (w_qkv, b_qkv), (w_gu, b_gu) = attn.qkv, mlp.gate_up
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            self.weights += [t for t in (*norms, w_qkv, b_qkv, attn.o_proj.weight, attn.o_proj.bias) if t is not None]
            self.weights += [t for t in (w_gu, b_gu, mlp.down_proj.weight, mlp.down_proj.bias) if t is not None]
            self.steps[i] = LayerStep(
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
                cos=_ptr(self.cos),
                sin=_ptr(self.sin),
                x=_ptr(self.x),
                k_new=_ptr(self.new_k[i]),
                v_new=_ptr(self.new_v[i]),
                scratch=_ptr(self.scratch),
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
        """x (B, 1, hidden) after the embedding -> the final norm of the last layer's output (B, 1, hidden); the cache
        gets every layer's new keys and values. NotSupported before anything runs when a layer's
        cache has a part no kernel reads."""
        pre = cache is not None and cache.pre_rope
        rope = rotary.halves if pre else None
        plans = self._plans(cache, rope)  # [layer][cache of the batch]: every plan before any layer runs
        for i, (step, layer) in enumerate(zip(self.steps, plans)):
            if [id(p) for p in layer] != self.plan_ids[i]:  # a plan made anew (a KVCache refreshes its own in place)
                pointers = (ctypes.POINTER(LayerPlan) * len(layer))(*(ctypes.pointer(p) for p in layer))
                self.pointers[i] = pointers  # kept alive while the step points at them
                step.attn, step.nattn = pointers, len(layer)
                self.plan_ids[i] = [id(p) for p in layer]
        self.plans = plans  # (and the plans themselves alive while their ids are compared)
        if pre != self.pre_rope:
            for step in self.steps:
                step.pre_rope = int(pre)
            self.pre_rope = pre
        self.x.copy_(x)  # (B, 1, hidden), updated in place layer by layer
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        ops.decode_layers(self.lib, self.steps)
        if isinstance(cache, KVCache):
            cache.count_kernel_read()
            cache.append_stacked(self.new_k, self.new_v)  # the one place the cache grows
        elif cache is not None:
            for member in _members(cache):
                if isinstance(member, KVCache):
                    member.count_kernel_read()
                else:
                    for i in range(len(self.steps)):
                        member.layer(i).count_kernel_read()
            # fresh tensors: another cache may keep what it is given, and the step reuses its buffers
            new_k, new_v = self.new_k.clone(), self.new_v.clone()  # (L, B, Hkv, 1, D) each
            cache.append(list(zip(new_k, new_v)))
        return ops.add_rms_norm(self.lib, self.x, None, self.norm, self.eps)[1]  # final norm: a new tensor

    def _plans(self, cache: Cache | None, rope) -> list[list[LayerPlan]]:
        """Each layer's attention plans, one per cache whose rows the batch holds in turn (a
        ``CacheGroup`` holds several): a ``KVCache`` keeps its own between steps (refreshed in
        place); another cache is described anew."""
        if cache is None:
            return self.no_cache
        r = self.hq // self.hkv
        per_cache = []
        self._keep: list = []  # alive while the layers run
        for member in _members(cache):
            if isinstance(member, KVCache):
                per_cache.append(member.kernel_plans(self.lib, r, rope))
            else:
                per_cache.append(
                    [
                        layer_plan(self.lib, member.layer(i), self.batch, r, self.d, rope, self._keep)
                        for i in range(len(self.steps))
                    ]
                )
        return [list(layer) for layer in zip(*per_cache)]


def _members(cache: Cache) -> list:
    """The caches whose rows the batch holds, in order: a ``CacheGroup``'s, or the cache itself."""
    return cache.caches if isinstance(cache, CacheGroup) else [cache]


def kernels(device=None):
    """The compiled library when the backend runs the kernels (native/backend.py), else None: what
    ``decode`` steps with, and what ``bench`` times its parts with."""
    return backend.library(device)


def fast_paths() -> bool:
    """Whether the PyTorch layers may use PyTorch's fused attention for prefill chunks (every
    backend but ``reference``, which is the plain math throughout)."""
    return backend.fast_paths()


def decode(
    model, x: torch.Tensor, positions: torch.Tensor, cache: Cache | None, rotary=None, logits: bool = True
) -> torch.Tensor | None:
    """The kernel-or-PyTorch decision, made here only. x (B, 1, hidden) after the embedding, one token
    per sequence at `positions`: on the kernels backend the whole step -- every layer in one native
    call, the final norm, and with `logits` the LM head (the matrix-vector kernel) -> (B, 1, vocab),
    else the final hidden state (B, 1, hidden); the cache grown. None when the PyTorch layers run
    instead: not a decode step, the reference backend, a dtype or layout the step does not take,
    or a cache part no kernel reads (recorded as a fallback; nothing ran)."""
    if x.shape[1] != 1:  # a prefill chunk: the PyTorch layers, fused attention (fast_paths)
        return None
    lib = kernels(x.device)
    if lib is None:  # the reference backend, or no kernels on this machine (describe() says why)
        return None
    if x.dtype not in (torch.float32, torch.bfloat16) or model.model.layers[0].self_attn.qkv is None:
        backend.fallback(
            f"decode step: {x.dtype} weights or unfused projections (the step takes fused float32/bfloat16)"
        )
        return None
    if torch.is_grad_enabled():
        backend.fallback("decode step: autograd is on (the kernels run under torch.no_grad() or inference_mode)")
        return None
    cos, sin = rope_tables(model.inv_freq, positions, torch.float32)  # (1, D) each
    try:
        h = native_step(model, lib, x.shape[0]).run(x, cos, sin, cache, rotary)  # (B, 1, hidden)
    except NotSupported as e:
        backend.fallback(f"decode step: {e}")
        return None
    return lm_head(lib, model.lm_head.weight, h) if logits else h


def lm_head(lib, weight: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """h (B, 1, hidden) -> logits (B, 1, vocab) in h's dtype, rounded once as F.linear rounds: the
    head's weights streamed by the matrix-vector kernel."""
    try:
        y = ops.gemm_rows(lib, h.reshape(h.shape[0], -1), weight)  # (B, vocab) float32
    except NotSupported as e:  # the step has run: the same product in PyTorch, recorded
        backend.fallback(f"LM head {tuple(weight.shape)} {weight.dtype}: {e}")
        return torch.nn.functional.linear(h, weight)
    return y.to(h.dtype).unsqueeze(1)  # (B, 1, vocab)


def native_step(model, lib, batch: int) -> NativeStep:
    """The model's layers described to the native step for this batch size, built on first use and
    kept on the model (``model._native_steps``: derived data, dropped when ``.to()`` or an assigning
    ``load_state_dict`` gives the weights new storage; the step keeps the tensors it points at
    alive, so a pointer never outlives its memory)."""
    key = (id(lib), batch, model.dtype)
    if key not in model._native_steps:
        model._native_steps[key] = NativeStep(model, lib, batch)
    return model._native_steps[key]
