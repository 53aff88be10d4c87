"""The decode step on the kernels backend: every layer in one native call (native/step.cpp).

``model/llama.py`` is the specification, plain PyTorch: for one token per sequence its
``DecoderLayer`` makes about twenty PyTorch calls, each costing microseconds of dispatch on a
small CPU. ``decode`` is the other path (native/fast.py chooses it): a step of one token per
sequence over a ``KVCache`` (or a group of them) runs here, whole or not at all; anything else
-- prefill, another cache, a part no kernel reads, the reason recorded (native/backend.py:
fallback) -- runs the PyTorch layers.

``NativeStep`` describes the step to C++ once (each layer's weights, norms and biases; the
embedding table, final norm and LM head: pointers that never change) and per step adds what
does: the tokens, the RoPE angles of the position, the output tensor and the attention plans of
the layers' caches (native/plans.py), and the cache write of the step's token, described from the
cache's counters before the step fills the new keys and values (native/token_write.py). One native
call then runs the embedding rows, every layer, the final norm and the LM head, and last the
cache write (native/encode.cpp: write_tokens, all or nothing); a write the kernel refuses is
appended after the call instead. Tests hold the logits of both paths equal, and the rings to the
bytes of the PyTorch write (tests/test_step.py).
"""

from __future__ import annotations

import ctypes
import time
import weakref

import torch

from minillama.kv.cache import KVCache
from minillama.kv.group import CacheGroup
from minillama.kv.interface import Cache
from minillama.model.attention import sdpa
from minillama.model.rope import rope_tables
from minillama.native import backend, ops
from minillama.native.abi import (
    BLOCK_CODE,
    DTYPE_CODE,
    INT8_ACTIVATIONS,
    STATUS,
    STATUS_OK,
    LayerPlan,
    LayerStep,
    NotSupported,
    StepEnds,
)
from minillama.native.plans import CachePlans
from minillama.native.threads import ThreadChooser
from minillama.native.token_write import CacheWrites
from minillama.native.weights import fused_rows
from minillama.native.write import KernelWriter
from minillama.weights.layers import block_kinds


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


class NativeStep:
    """One model described to the C++ decode step, for `batch` sequences in `dtype`; NotSupported
    when a tensor it would point at is not one the step reads."""

    def __init__(self, model, lib, batch: int):
        cfg = model.config
        self.lib, self.batch, self.dtype = lib, batch, model.dtype
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise NotSupported(f"{self.dtype} weights (the step takes float32 and bfloat16)")
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        codes = {}
        for name, module in (("embedding", model.model.embed_tokens), ("LM head", model.lm_head)):
            t, block = module.weight, getattr(module, "kind", None)
            if (t.dtype != self.dtype and not block) or not t.is_contiguous():
                raise NotSupported(f"{name} {tuple(t.shape)} {t.dtype}: the step reads contiguous {self.dtype} rows")
            codes[name] = BLOCK_CODE[block] if block else DTYPE_CODE[self.dtype]
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.n_kv_heads, cfg.head_dim
        n = cfg.num_hidden_layers
        self.new_k = torch.empty(n, batch, self.hkv, 1, self.d, dtype=self.dtype)  # (L, B, Hkv, 1, D)
        self.new_v = torch.empty_like(self.new_k)
        size = lib.step_scratch_bytes(
            batch, cfg.hidden_size, self.hq, self.hkv, self.d, cfg.intermediate_size, DTYPE_CODE[self.dtype]
        )
        self.scratch = torch.empty(size, dtype=torch.uint8)
        self.weights: list[torch.Tensor] = []  # every tensor a LayerStep points at, kept alive with it
        # The residual stream, at a fixed address every layer points at (written by the step only),
        # and the head's float32 product before rounding.
        self.x = torch.empty(batch, 1, cfg.hidden_size, dtype=self.dtype)  # (B, 1, hidden)
        self.product = torch.empty(batch, cfg.vocab_size)  # (B, vocab) float32
        self.inv_freq = model.inv_freq
        self.angles: tuple[int, torch.Tensor, torch.Tensor] = (0, torch.empty(0), torch.empty(0))
        self.hidden, self.vocab = cfg.hidden_size, cfg.vocab_size
        norm = model.model.norm
        self.weights += [embed, head, norm.weight]
        self.ends = StepEnds(
            embed=_ptr(embed),
            norm=_ptr(norm.weight),
            product=_ptr(self.product),
            vocab=cfg.vocab_size,
            eps=norm.eps,
            embed_dtype=codes["embedding"],
            head_dtype=codes["LM head"],
        )
        self.head = _ptr(head)
        self.steps = (LayerStep * n)()  # one contiguous array: the whole step is one native call
        self.pre_rope = False
        self.int8 = False  # block weights against activations rounded to int8 (the kernels backend)
        self.plans: list[list[LayerPlan]] = []  # [cache of the batch][layer]: the plans the layers point at now
        self.plan_ids: list[int] = []
        self.pointers: list = [None] * n  # each layer's array of plan pointers
        self.no_cache = [[LayerPlan(B=batch) for _ in range(n)]]  # the plans of a step without a cache: no parts
        # Per cache: its layers' plans and its token writes, described on its first step (and again
        # when it rebuilds its stores: an auto spec's choice, a reset).
        self.caches: weakref.WeakKeyDictionary[KVCache, tuple[list, CachePlans, CacheWrites]] = (
            weakref.WeakKeyDictionary()
        )
        self.writer = KernelWriter(lib)
        self.chooser: ThreadChooser | None = None  # every core or one fewer (backend.adaptive)
        self.one_core = False
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv_kinds, o_kind, gu_kinds, down_kind = block_kinds(layer)  # None: the model's dtype
            code = [BLOCK_CODE[k] if k else DTYPE_CODE[self.dtype] for k in (*qkv_kinds, o_kind, *gu_kinds, down_kind)]
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
            w_qkv, b_qkv, w_kv, kv_dtype = group_rows(qkv, code[0:3], f"layer {i}: q/k/v")  # (Hq D + 2 Hkv D, hidden)
            w_gu, b_gu, w_up, up_dtype = group_rows([mlp.gate_proj, mlp.up_proj], code[4:6], f"layer {i}: gate/up")
            wdtype = [code[0], code[3], code[4], code[6]]  # q (or q/k/v), o, gate (or gate/up), down
            self.weights += w_kv + w_up
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
                wdtype=(ctypes.c_int * 4)(*wdtype),
                w_kv=(ctypes.c_void_p * 2)(*(_ptr(t) for t in w_kv or (None, None))),
                kv_dtype=(ctypes.c_int * 2)(*(kv_dtype or (0, 0))),
                w_up=_ptr(w_up[0] if w_up else None),
                up_dtype=up_dtype[0] if up_dtype else 0,
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
                x=_ptr(self.x),
                k_new=_ptr(self.new_k[i]),
                v_new=_ptr(self.new_v[i]),
                scratch=_ptr(self.scratch),
            )

    def time_phases(self, timing: torch.Tensor | None) -> None:
        """Profiling: the step adds the wall seconds of its layers' projections, attention and the
        rest, of its final norm and LM head, and of its cache write to timing (5,) float64
        (tools/step_profile.py); None stops it."""
        ptr = ctypes.cast(timing.data_ptr(), ctypes.POINTER(ctypes.c_double)) if timing is not None else None
        self._timing = timing  # kept alive while the kernels write to it
        for step in self.steps:
            step.timing = ptr

    def run(
        self, tokens: torch.Tensor, position: int, cache: Cache | None, rotary=None, logits=True, int8=False
    ) -> torch.Tensor:
        """tokens (B, 1) at `position` -> logits (B, 1, vocab), or without `logits` the final norm of
        the last layer's output (B, 1, hidden), in the model's dtype; the cache gets every layer's
        new keys and values. NotSupported before anything runs when a layer's cache has a part no
        kernel reads. `int8`: block-weight products round their activations to int8 per block."""
        pre = cache is not None and cache.pre_rope
        rope = rotary.halves if pre else None
        plans = self._plans(cache, rope)  # [cache of the batch][layer]: every plan before any layer runs
        ids = [id(p) for member in plans for p in member]
        if ids != self.plan_ids:  # a plan made anew (a KVCache refreshes its own in place)
            for i, (step, layer) in enumerate(zip(self.steps, zip(*plans))):
                pointers = (ctypes.POINTER(LayerPlan) * len(layer))(*(ctypes.pointer(p) for p in layer))
                self.pointers[i] = pointers  # kept alive while the step points at them
                step.attn, step.nattn = pointers, len(layer)
            self.plan_ids = ids
        self.plans = plans  # (and the plans themselves alive while their ids are compared)
        if pre != self.pre_rope:
            for step in self.steps:
                step.pre_rope = int(pre)
            self.pre_rope = pre
        if int8 != self.int8:
            self._round_activations(int8)
        if tokens.dtype != torch.int64 or not tokens.is_contiguous():
            tokens = tokens.to(torch.int64).contiguous()  # (B, 1): B consecutive ids
        out = torch.empty(self.batch, 1, self.vocab if logits else self.hidden, dtype=self.dtype)
        e = self.ends
        e.tokens, e.out = tokens.data_ptr(), out.data_ptr()
        e.cos, e.sin = self._angles(position)
        e.head = self.head if logits else None
        # The cache write, described from the counters before the step fills new_k and new_v, is
        # made by the same native call, last; where it cannot be, the cache writes them after.
        state = self.caches.get(cache) if isinstance(cache, KVCache) else None
        writes = state[2].describe(self.new_k, self.new_v) if state is not None else None
        e.writes, e.nwrites = (writes.array, len(writes.array)) if writes is not None else (None, 0)
        chooser = self._chooser()
        if chooser is not None:
            chooser.before()
            started = time.perf_counter()
        ops.decode_step(self.lib, self.steps, e)
        if chooser is not None:
            chooser.after(time.perf_counter() - started)
        backend.ran("decode step")
        if isinstance(cache, KVCache):  # the one place the cache grows
            cache.count_full_read()
            if writes is not None and e.write_status == STATUS_OK:
                state[2].commit(writes)
                backend.ran("token write")
            else:  # no native write, or one refused (non-finite values: the PyTorch write says so)
                if writes is not None:
                    backend.fallback(f"decode step's cache write: {STATUS.get(e.write_status)} (the cache writes it)")
                cache.append_stacked(self.new_k, self.new_v, self.writer)
        elif cache is not None:  # a group: every member read in place, each appended its rows
            for member in cache.caches:
                member.count_full_read()
            cache.append(list(zip(self.new_k, self.new_v)), self.writer)
        return out

    def _round_activations(self, int8: bool) -> None:
        """Every block-weight product (projections and head) with activations rounded to int8 per
        block, or in float (kernels-exact): the flag INT8_ACTIVATIONS on their weight codes."""
        blocks = set(BLOCK_CODE.values())

        def flagged(code: int) -> int:
            plain = code & ~INT8_ACTIVATIONS
            return plain | INT8_ACTIVATIONS if int8 and plain in blocks else plain

        for step in self.steps:
            for codes in (step.wdtype, step.kv_dtype):
                for i in range(len(codes)):
                    codes[i] = flagged(codes[i])
            step.up_dtype = flagged(step.up_dtype)
        self.ends.head_dtype = flagged(self.ends.head_dtype)
        self.int8 = int8

    def _chooser(self) -> ThreadChooser | None:
        """The thread chooser where the backend lets steps adapt (``backend.adaptive``), else None
        (and every core again, if a chooser had taken one away)."""
        if not backend.adaptive():
            if self.chooser is not None and self.chooser.set != self.chooser.counts[0]:
                self.lib.minillama_set_threads(self.chooser.counts[0])
            self.chooser = None
            return None
        if self.chooser is None and not self.one_core:
            most = backend.threads()
            self.one_core = most < 2  # nothing to choose between: asked once, not every step
            self.chooser = None if self.one_core else ThreadChooser(self.lib, most)
        return self.chooser

    def _angles(self, position: int) -> tuple[int, int]:
        """Where the RoPE angles of `position` are, cos and sin (D,) float32 each (rope_tables'
        numbers), made for 64 positions at a time: a step usually takes the row after the last
        one's. Addresses, not views: two tensor indexings cost more than the arithmetic."""
        first, cos, sin = self.angles
        if not first <= position < first + cos.shape[0]:
            first = position
            cos, sin = rope_tables(self.inv_freq, torch.arange(first, first + 64), torch.float32)  # (64, D) each
            self.angles = (first, cos, sin)
        row = (position - first) * cos.shape[1] * 4  # bytes: float32 rows of D
        return cos.data_ptr() + row, sin.data_ptr() + row

    def _plans(self, cache: Cache | None, rope) -> list[list[LayerPlan]]:
        """[cache][layer]: each layer's attention plan in each cache whose rows the batch holds in
        turn (a ``CacheGroup`` holds several), kept per cache between steps and refreshed in place.
        NotSupported for a cache other than these (its layers are attended by the reference)."""
        if cache is None:
            return self.no_cache
        if isinstance(cache, KVCache):
            members = [cache]
        elif isinstance(cache, CacheGroup):
            members = cache.caches
        else:
            raise NotSupported(f"a {type(cache).__name__}: the step reads a KVCache's rings in place")
        r = self.hq // self.hkv
        per_cache = []
        for member in members:
            state = self.caches.get(member)
            if state is None or state[0] is not member.stores:  # new, or its stores rebuilt
                state = self.caches[member] = (member.stores, CachePlans(self.lib, member, r), CacheWrites(member))
            per_cache.append(list(state[1].refresh(member, rope)))  # a copy: refreshed in place
        return per_cache


def chunk_attention(lib):
    """How the PyTorch layers attend a chunk of new tokens on the kernels backend (model/attention.py:
    attend's ``fused``): native/prefill_attention.cpp where it takes the shape (float32, head_dim 64,
    80, 96, 128 or 256), else PyTorch's SDPA (the reason recorded)."""

    def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        try:
            out = ops.causal_attention(lib, q, k, v)  # (B, Hq, T, D)
            backend.ran("prefill attention")
            return out
        except NotSupported as e:
            backend.fallback(f"prefill attention: {e}")
        return sdpa(q, k, v)

    return fused


def decode(model, lib, tokens: torch.Tensor, cache: Cache | None, logits: bool = True) -> torch.Tensor | None:
    """tokens (B, 1), one per sequence: the whole step -- the embedding rows, every layer, the final
    norm and with `logits` the LM head, in one native call -> (B, 1, vocab), else the final hidden
    state (B, 1, hidden); the cache grown. None when the PyTorch layers run instead: not a decode
    step, a cache that still chooses its codecs, a dtype or layout the step does not take, or a
    cache no kernel reads (recorded as a fallback; nothing ran)."""
    if tokens.shape[1] != 1:  # a prefill chunk: the PyTorch layers, fused attention (chunk_attention)
        return None
    if getattr(cache, "choosing", False):  # bits=auto before its choice: the first append chooses
        return None
    if torch.is_grad_enabled():
        backend.fallback("decode step: autograd is on (the kernels run under torch.no_grad() or inference_mode)")
        return None
    position = cache.next_position if cache is not None else 0
    rotary = model.rotary_table(position + 1) if cache is not None and cache.pre_rope else None
    try:
        return native_step(model, lib, tokens.shape[0]).run(
            tokens, position, cache, rotary, logits, int8_products(model)
        )
    except NotSupported as e:
        backend.fallback(f"decode step: {e}")
        return None


def int8_products(model) -> bool:
    """Whether `model`'s block-weight products round their activations to int8 now: the model
    asks for it (native/fast.py: FastLlama.round_activations) and the backend is not kernels-exact."""
    return getattr(model, "int8_activations", False) and not backend.exact_arithmetic()


def group_rows(layers: list, codes: list[int], what: str) -> tuple:
    """A group of projections of one input (q/k/v, gate/up) as the step reads it: (weight, bias,
    apart, their codes). Stored alike, one fused (sum of outs, in) weight and nothing apart; in
    different types (a Q4_K_M file keeps some v rows in Q6_K), the first layer's rows, the others'
    weights and codes apart (native/step.cpp: products_apart), and the group's biases joined."""
    if len(set(codes)) == 1:
        return (*fused_rows(layers), [], [])
    if not all(m.weight.is_contiguous() for m in layers):
        raise NotSupported(f"{what} weights not contiguous")
    bias = torch.cat([m.bias for m in layers]) if layers[0].bias is not None else None  # (sum of outs)
    return layers[0].weight, bias, [m.weight for m in layers[1:]], list(codes[1:])


def native_step(model, lib, batch: int) -> NativeStep:
    """The model described to the native step for this batch size, built on first use and
    kept on the model (``model.steps``, native/fast.py: derived data, dropped when ``.to()`` or an
    assigning ``load_state_dict`` gives the weights new storage; the step keeps the tensors it
    points at alive, so a pointer never outlives its memory)."""
    key = (id(lib), batch, model.dtype)
    if key not in model.steps:
        model.fuse()
        model.steps[key] = NativeStep(model, lib, batch)
    return model.steps[key]
