"""The Llama on the compiled path: the core model, with its steps taken by the kernels where they apply.

``model/llama.py: Llama`` is the specification, plain PyTorch, and knows nothing of this wing.
``FastLlama`` is the same module (a subclass: the same parameters, the same ``forward``) whose
forward asks the one backend switch (native/backend.py) which path runs:

* the reference backend, or no kernels on this machine: the core forward, unchanged;
* a decode step (one token per sequence) over a ``KVCache``: the whole step in one native call
  (native/step.py), or the core forward where it cannot run (the reason recorded);
* anything else (a prefill chunk): the core layers, with the native causal attention for the
  chunk and the kernels' cache write (native/write.py) handed to the cache through ``KernelCache``.

``load_model`` is the core loader's, returning a ``FastLlama``: what the CLI and ``minillama.load_model``
give. Tests hold every path to the core's numbers and count the native calls that ran.
"""

from __future__ import annotations

import torch

from minillama.errors import UserError
from minillama.kv.cache import KVCache
from minillama.kv.group import CacheGroup
from minillama.kv.interface import Cache, LayerView
from minillama.kv.write import Writer
from minillama.model import loader
from minillama.model.linear import project
from minillama.model.llama import Llama
from minillama.native import backend, ops
from minillama.native.step import chunk_attention, decode
from minillama.native.threads import prefill_threads
from minillama.native.weights import fuse
from minillama.native.write import KernelWriter, writer
from minillama.weights.blocks import round_activations
from minillama.weights.gguf import load_gguf
from minillama.weights.layers import BlockLinear, quantize_model

SKINNY_ROWS = 16  # rows of x up to which the block kernel beats widening the weights for torch's product


class KernelCache:
    """A ``KVCache`` (or a group of them) seen through the Cache protocol, its appends written by
    the kernels' writer: what the core forward is handed on the kernels backend."""

    def __init__(self, cache: KVCache | CacheGroup, writer: Writer):
        self.cache, self.writer = cache, writer

    @property
    def held(self) -> int:
        return self.cache.held

    @property
    def pre_rope(self) -> bool:
        return self.cache.pre_rope

    @property
    def next_position(self) -> int:
        return self.cache.next_position

    def layer(self, i: int) -> LayerView:
        return self.cache.layer(i)

    def append(self, new_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.cache.append(new_kv, self.writer)


class FastBlockLinear(BlockLinear):
    """A ``BlockLinear`` (weights/layers.py) whose product asks the backend: on the kernels, a few
    rows go through the block kernel (gemm_rows: every block read once), a prompt's chunk through
    the weights widened natively and torch's product (model/linear.py: project); the reference
    (dequantize in PyTorch, then multiply) otherwise. On the kernels backend both round x to int8
    per block first (weights/blocks.py: round_activations), as llama.cpp does, so a prompt and a
    decode step round alike; kernels-exact, and a model told ``round_activations(False)``, keep x
    in float."""

    int8 = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib = backend.library(x.device)
        if lib is None:
            return super().forward(x)
        rows = x.reshape(-1, self.in_features)  # (M, in)
        int8 = self.int8 and not backend.exact_arithmetic()  # x rounded to int8 per block, as llama.cpp does
        if rows.shape[0] <= SKINNY_ROWS:
            y = ops.gemm_rows(lib, rows, self.weight, self.kind, int8)  # (M, out) float32, rounded once below
            y = (y + self.bias.float() if self.bias is not None else y).to(x.dtype)
            backend.ran("block product")
        else:
            if int8:  # the kernel's rounding (float order still differs: a code may flip between the two)
                rows = round_activations(rows).to(x.dtype)  # (M, in)
            y = project(rows, ops.dequantize_rows(lib, self.weight, self.kind, self.in_features, x.dtype), self.bias)
            backend.ran("block widening")
        return y.view(*x.shape[:-1], self.out_features)  # (..., out)


class FastLlama(Llama):
    """A ``Llama`` whose forward takes the compiled path where the backend runs the kernels."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.steps: dict = {}  # (library, batch, dtype) -> the native step's description (native/step.py)
        self.laid_out = False  # q/k/v and gate/up side by side, every weight in one buffer (native/weights.py)

    @classmethod
    def from_llama(cls, model: Llama) -> FastLlama:
        """`model` itself, now a FastLlama (nothing is copied)."""
        model.__class__ = cls
        model.steps, model.laid_out = {}, False
        for module in model.modules():
            if isinstance(module, BlockLinear):
                module.__class__ = FastBlockLinear
        model.round_activations(True)
        if model.device.type == "cpu":
            model.fuse()  # now, as part of loading, rather than in the first decode step
        return model

    def round_activations(self, on: bool) -> None:
        """Whether block-weight products round their activations to int8 per block on the kernels
        backend (the default: faster decoding, as llama.cpp). The rulers (ppl, needle) turn it off:
        a code that flips between a prompt's product and a decode step's (their float sums differ
        in order) would add its own noise to what the cache costs."""
        self.int8_activations = on
        for module in self.modules():
            if isinstance(module, FastBlockLinear):
                module.int8 = on

    def fuse(self) -> None:
        """Lay the weights out as the native step reads them (once; again after they move)."""
        if not self.laid_out:
            with torch.inference_mode(False):  # the weights stay normal tensors, whoever asks first
                fuse(self)
            self.laid_out = True

    def _apply(self, fn, recurse: bool = True):
        """``.to()`` and the like give the parameters new storage: what was derived from the old
        (the fused layout, the native steps' pointers) is made again on the next step."""
        super()._apply(fn, recurse)
        self.steps.clear()
        self.laid_out = False
        return self

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As ``nn.Module``'s; ``assign=True`` replaces the parameters, so the derived layout goes."""
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if assign:
            self.steps.clear()
            self.laid_out = False
        return result

    def cache_writer(self) -> Writer:
        return writer(self.device)

    def _run(self, tokens: torch.Tensor, cache: Cache | None, last_only: bool, logits: bool, fused=None):
        lib = backend.library(tokens.device)
        if lib is None:  # the reference backend, or no kernels here (backend.describe() says why)
            return super()._run(tokens, cache, last_only, logits)
        out = decode(self, lib, tokens, cache, logits)  # the whole step in one native call, or None
        if out is not None:
            return out  # (B, 1, vocab or hidden)
        if isinstance(cache, (KVCache, CacheGroup)):
            cache = KernelCache(cache, KernelWriter(lib))
        if not backend.adaptive() or tokens.shape[1] == 1:
            return super()._run(tokens, cache, last_only, logits, chunk_attention(lib))
        most, before = backend.threads(), lib.minillama_threads()
        n = prefill_threads(most)  # a prompt's chunk: one core fewer beside a busy process (threads.py)
        torch.set_num_threads(n)
        lib.minillama_set_threads(n)
        try:
            return super()._run(tokens, cache, last_only, logits, chunk_attention(lib))
        finally:
            torch.set_num_threads(most)
            lib.minillama_set_threads(before)  # what the decode steps' chooser had set


def load_model(name: str, *args, weights: str | None = None, **kwargs) -> loader.LoadedModel:
    """``model/loader.py: load_model`` with its model on the compiled path (``FastLlama``). A
    ``.gguf`` file keeps its q8_0 / q4_0 / q4_1 weights as stored (weights/gguf.py); with `weights`
    (q8_0, q4_0, q4_1) a folder's projections are quantized into those blocks (weights/layers.py)."""
    if str(name).endswith(".gguf"):
        if weights:
            raise UserError("a GGUF's weights are used as stored: --weights is for model folders")
        lm = load_gguf(name, *args, **kwargs)
    else:
        lm = loader.load_model(name, *args, **kwargs)
        if weights:
            quantize_model(lm.model, weights)
    FastLlama.from_llama(lm.model)
    return lm
