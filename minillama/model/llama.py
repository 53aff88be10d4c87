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

from minillama.kv.interface import Cache, Probe
from minillama.model import step
from minillama.model.attention import attend, attend_cache
from minillama.model.config import LlamaConfig
from minillama.model.linear import Linear, concat_rows, project
from minillama.model.rope import RotaryTable, apply_rope, inverse_frequencies, rope_tables
from minillama.model.weights import pack_weights


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

        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # set by Llama.fuse_projections()

    def forward(self, x, cos, sin, cache: Cache | None, layer: int, rotary: RotaryTable | None = None, fused=None):
        """x (B, T, hidden); cos, sin (T, D) for the new tokens' positions. Returns the output, the
        (k, v) to store: k after RoPE, or before it when the cache keeps pre-RoPE keys, and the queries
        q (B, Hq, T, D) after RoPE (a cache may ask for the newest: ``wants_queries``). ``fused``:
        the fused attention for the new tokens, or None for the explicit math (model/attention.py)."""
        b, t, _ = x.shape
        if self.qkv is not None:  # one matrix product for q, k and v (their weights are views of it)
            qkv = project(x, *self.qkv)  # (B, T, (Hq + 2 Hkv) D)
            q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        else:
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
        return self.o_proj(out), (stored, v), q


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None  # set by Llama.fuse_projections()

    def forward(self, x):
        if self.gate_up is not None:  # gate and up in one matrix product
            gate, up = project(x, *self.gate_up).chunk(2, dim=-1)  # (..., I) each
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)  # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def error_weight(self, x: torch.Tensor) -> float:
        """How much an error e in this layer's attention output weighs downstream, for x (B, T, hidden)
        the residual stream entering it: e reaches the stream as o_proj(e), about ||W_o||_F^2 ||e||^2
        in squared norm for an error with no preferred direction, and the next RMSNorm divides the
        stream by its norm, so relative to the median token's ||x||^2 (the median leaves out the few
        tokens of massive activations: the BOS). kv/auto.py prices a layer's codecs by it."""
        typical = x.float().pow(2).sum(-1).flatten().median()  # ()
        return float(self.self_attn.o_proj.weight.float().pow(2).sum() / typical.clamp_min(1e-30))

    def forward(self, x, cos, sin, cache, layer, rotary=None, fused=None):
        h, kv, q = self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, rotary, fused)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv, q


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
        self._native_steps: dict = {}  # (library, batch, dtype) -> the native step's description (model/step.py)

    def fuse_projections(self) -> Llama:
        """Concatenate q/k/v and gate/up weights so each group is one matrix product.

        The separate projections become views into the fused weights (no extra memory),
        so loading, the reference path and ``state_dict`` are unchanged. Then every weight moves
        into one buffer of huge pages (model/weights.py: decode streams them all each token)."""
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv = concat_rows([attn.q_proj, attn.k_proj, attn.v_proj])
            mlp.gate_up = concat_rows([mlp.gate_proj, mlp.up_proj])
        fused = [(layer.self_attn, "qkv") for layer in self.model.layers]
        pack_weights(self, fused + [(layer.mlp, "gate_up") for layer in self.model.layers])
        return self

    def _apply(self, fn, recurse: bool = True):
        """``.to()``, ``.float()``, ``.bfloat16()`` ... give the parameters new storage. The fused
        projections and the native step's weight pointers are derived from it, so they are made
        again from the converted parameters rather than left behind (stale weights, or pointers
        into freed memory); RoPE's speeds are not weights and stay float32."""
        fused = self._fused()
        inv_freq = self.inv_freq  # (D/2,) float32
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)  # RoPE speeds stay float32 in any dtype, as loaded
        self._derived_changed(fused)
        return self

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As ``nn.Module``'s. A plain load copies into the existing parameters, which the fused
        weights share and the native step points at; ``assign=True`` replaces them, so what is
        derived from them is made again."""
        fused = self._fused()
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if assign:
            self._derived_changed(fused)
        return result

    def _fused(self) -> bool:
        return any(layer.self_attn.qkv is not None for layer in self.model.layers)

    def _derived_changed(self, fused: bool) -> None:
        self._native_steps.clear()  # rebuilt on the next step from the parameters as they are now
        self.rotary = None
        if fused:
            self.fuse_projections()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

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

    def _run(self, tokens: torch.Tensor, cache: Cache | None, last_only: bool, logits: bool) -> torch.Tensor:
        b, t = tokens.shape
        first = cache.next_position if cache is not None else 0  # the position of tokens[:, 0]
        rotary = None
        if cache is not None and cache.pre_rope:
            if self.rotary is None or self.rotary.inv_freq.device != self.inv_freq.device:
                self.rotary = RotaryTable(self.inv_freq)
            rotary = self.rotary
            rotary.get(first + t)  # every position a key of this step can have
        out = step.decode(self, tokens, first, cache, rotary, logits)  # the kernels backend's whole step
        if out is not None:
            return out  # (B, 1, vocab or hidden)
        x = self.model.embed_tokens(tokens)  # (B, T, hidden)
        positions = torch.arange(first, first + t, device=tokens.device)  # (T,)
        cos, sin = rope_tables(self.inv_freq, positions, self.dtype)  # (T, D) each
        fused = step.chunk_attention()
        new_kv = []
        asked = cache.wants_queries if cache is not None else 0  # an auto cache chooses its codecs from these
        probes = [] if asked else None  # per layer: the newest queries, the weight of an output error
        for i, layer in enumerate(self.model.layers):
            weight = layer.error_weight(x) if asked else 0.0
            x, kv, q = layer(x, cos, sin, cache, i, rotary, fused)
            new_kv.append(kv)
            if probes is not None:
                probes.append(Probe(q[:, :, -asked:], weight))  # (B, Hq, m, D)
        if cache is not None:
            cache.append(new_kv, probes)  # the one place the cache grows
        if last_only:
            x = x[:, -1:]
        x = self.model.norm(x)  # (B, T, hidden)
        return self.lm_head(x) if logits else x
