"""The Llama model (Touvron et al. 2023), as in Hugging Face's ``LlamaForCausalLM``.

Parameter names are HF's so a checkpoint loads as an identity map. The cache is an
explicit argument: ``model(tokens, cache)`` reads each layer's past from the cache,
and writes the new keys and values in one ``cache.append`` call at the end. With
``cache=None`` the call is a plain causal forward over ``tokens`` (no past).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minillama.kv.interface import Cache
from minillama.kv.write import REFERENCE, Writer
from minillama.model.attention import Fused, attend, attend_cache
from minillama.model.config import LlamaConfig
from minillama.model.linear import Linear
from minillama.model.rope import RotaryTable, apply_rope, inverse_frequencies, rope_tables


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 like HF, then scale in the model dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.n_kv_heads
        self.hq, self.hkv, self.d = hq, hkv, d
        self.q_proj = Linear(cfg.hidden_size, hq * d, bias=cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden_size, hkv * d, bias=cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, hkv * d, bias=cfg.attention_bias)
        self.o_proj = Linear(hq * d, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: Cache | None,
        layer: int,
        rotary: RotaryTable | None = None,
        fused: Fused | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x (B, T, hidden); cos, sin (T, D) for the new tokens' positions. Returns the output and the
        (k, v) to store: k after RoPE, or before it when the cache keeps pre-RoPE keys. ``fused``:
        how a chunk attends (model/attention.py: attend), None for the explicit math."""
        b, t, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(b, t, self.hq, self.d).transpose(1, 2)  # (B, Hq, T, D)
        k = k.reshape(b, t, self.hkv, self.d).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.reshape(b, t, self.hkv, self.d).transpose(1, 2)  # (B, Hkv, T, D)
        pre = cache is not None and cache.pre_rope
        q, k_rope = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        stored = k if pre else k_rope
        if cache is None:
            out = attend(q, k_rope, v, None, None, None, fused=fused)
        else:
            out = attend_cache(q, k_rope, v, cache.layer(layer), rotary if pre else None, fused)
        out = out.transpose(1, 2).reshape(b, t, self.hq * self.d)  # (B, T, Hq*D)
        return self.o_proj(out), (stored, v)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache, layer, rotary=None, fused=None):
        h, kv = self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, rotary, fused)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class Backbone(nn.Module):
    """HF's ``LlamaModel``: embeddings, decoder layers, final norm."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", inverse_frequencies(cfg), persistent=False)  # (D/2,)
        self.rotary: RotaryTable | None = None  # angles of every position, for keys stored before RoPE

    def _apply(self, fn, recurse: bool = True):
        """``.to()``, ``.float()``, ``.bfloat16()`` ... convert the parameters; RoPE's speeds are not
        weights and stay float32 in any dtype, as loaded (HF keeps them so too)."""
        inv_freq = self.inv_freq  # (D/2,) float32
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        self.rotary = None
        return self

    def cache_writer(self) -> Writer:
        """How this model's cache writes are computed (kv/write.py): the PyTorch reference; a model
        on the compiled path hands its kernels' writer instead (native/fast.py)."""
        return REFERENCE

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def forward(self, tokens: torch.Tensor, cache: Cache | None = None, last_only: bool = False) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab), or (B, 1, vocab) with last_only.

        With a cache, the tokens continue the cached sequence at ``cache.position`` and
        their keys/values are appended to it; without one, they start at position 0.
        """
        return self._run(tokens, cache, last_only, logits=True)  # (B, T, vocab)

    def hidden(self, tokens: torch.Tensor, cache: Cache | None = None, last_only: bool = False) -> torch.Tensor:
        """The final normalized hidden states (B, T, hidden) that ``lm_head`` turns into logits.

        Evaluations keep these instead of logits: 576 floats per token rather than 49k."""
        return self._run(tokens, cache, last_only, logits=False)

    def rotary_table(self, n: int) -> RotaryTable:
        """The angles of positions 0..n-1, for keys stored before RoPE (made once, grown as asked)."""
        if self.rotary is None or self.rotary.inv_freq.device != self.inv_freq.device:
            self.rotary = RotaryTable(self.inv_freq)
        self.rotary.get(n)
        return self.rotary

    def _run(
        self,
        tokens: torch.Tensor,
        cache: Cache | None,
        last_only: bool,
        logits: bool,
        fused: Fused | None = None,
    ) -> torch.Tensor:
        """The forward pass; ``fused``: how a chunk attends (model/attention.py: attend)."""
        b, t = tokens.shape
        first = cache.next_position if cache is not None else 0  # the position of tokens[:, 0]
        pre = cache is not None and cache.pre_rope
        rotary = self.rotary_table(first + t) if pre else None  # every position a key of this step can have
        x = self.model.embed_tokens(tokens)  # (B, T, hidden)
        positions = torch.arange(first, first + t, device=tokens.device)  # (T,)
        cos, sin = rope_tables(self.inv_freq, positions, self.dtype)  # (T, D) each
        new_kv = []
        for i, layer in enumerate(self.model.layers):
            x, kv = layer(x, cos, sin, cache, i, rotary, fused)
            new_kv.append(kv)
        if cache is not None:
            cache.append(new_kv)  # the one place the cache grows
        if last_only:
            x = x[:, -1:]
        x = self.model.norm(x)  # (B, T, hidden)
        return self.lm_head(x) if logits else x
