"""Layers whose weights stay in llama.cpp's blocks (blocks.py), and the transform that makes them.

As gpt-fast's weight-only quantization, a transform the model never knows about:
``quantize_model(model, "q4_0")`` replaces the projections of every layer (q/k/v, o, gate/up,
down) by ``BlockLinear``s holding the blocks llama.cpp would write, and the embedding table (and
the LM head, tied or not) by q8_0 blocks: llama.cpp keeps those at 6-8 bits whatever the file's
type, since every token's logits come from the head. ``forward`` is the reference everywhere:
dequantize, then multiply or look up. The native decode step reads the blocks in place
(native/linear.cpp, step.cpp): every weight read once a token at 4.5-8.5 bits instead of 16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minillama.errors import UserError
from minillama.weights.blocks import BLOCK_BYTES, KINDS, QK, WEIGHTS, dequantize, quantize

PROJECTIONS = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))


class BlockLinear(nn.Module):
    """y = x W^T + b with W (out, in) kept as rows of blocks: ``weight`` (out, in / QK * bytes) uint8."""

    def __init__(self, blocks: torch.Tensor, kind: str, in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        if in_features % WEIGHTS[kind] or blocks.shape[1] != in_features // WEIGHTS[kind] * BLOCK_BYTES[kind]:
            raise ValueError(f"{tuple(blocks.shape)} bytes are not rows of {in_features} weights in {kind} blocks")
        self.kind, self.in_features, self.out_features = kind, in_features, blocks.shape[0]
        self.weight = nn.Parameter(blocks, requires_grad=False)  # (out, in / 32 * bytes) uint8
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantize(self.weight, self.kind).to(x.dtype)  # (out, in)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"


class BlockEmbedding(nn.Module):
    """An embedding table (vocab, hidden) kept as q8_0 (or any kind's) rows of blocks: each looked-up
    row dequantized, in the model's dtype (``like`` follows the model's .to())."""

    def __init__(self, blocks: torch.Tensor, kind: str, dim: int, dtype: torch.dtype):
        super().__init__()
        self.kind, self.embedding_dim = kind, dim
        self.weight = nn.Parameter(blocks, requires_grad=False)  # (vocab, dim / 32 * bytes) uint8
        self.register_buffer("like", torch.empty(0, dtype=dtype), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = dequantize(self.weight[tokens.reshape(-1)], self.kind)  # (B T, dim) float32
        return rows.to(self.like.dtype).view(*tokens.shape, self.embedding_dim)  # (B, T, dim)


def quantize_model(model: nn.Module, kind: str) -> None:
    """Every decoder layer's projections as ``BlockLinear``s of `kind`, and the embedding table and
    the LM head as llama.cpp's quantizer stores them for that kind, in place: the head in q6_k for
    4-bit kinds (q8_0 where its rows are not whole 256-weight blocks, and for q8_0 models), an
    untied embedding in `kind`; a tied table is the head's (one tensor)."""
    quantize_linears(model, kind)
    embed, head = model.model.embed_tokens, model.lm_head
    tied = head.weight is embed.weight
    head_kind = "q6_k" if kind != "q8_0" and head.in_features % WEIGHTS["q6_k"] == 0 else "q8_0"
    embed_kind = head_kind if tied else kind
    blocks = quantize(embed.weight.detach(), embed_kind)  # (vocab, hidden / QK * bytes)
    model.model.embed_tokens = BlockEmbedding(blocks, embed_kind, embed.embedding_dim, embed.weight.dtype)
    head_blocks = model.model.embed_tokens.weight if tied else quantize(head.weight.detach(), head_kind)
    model.lm_head = BlockLinear(head_blocks, head_kind, head.in_features)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight  # one tensor, as the tie was


def quantize_linears(model: nn.Module, kind: str) -> None:
    """Every decoder layer's projections as ``BlockLinear``s of `kind`, in place."""
    if kind not in KINDS:
        raise UserError(f"unknown weight blocks {kind!r}: choose {', '.join(KINDS)}")
    for layer in model.model.layers:
        for part, names in PROJECTIONS:
            module = getattr(layer, part)
            for name in names:
                linear = getattr(module, name)
                if linear.in_features % QK:
                    raise UserError(
                        f"{name} has {linear.in_features} inputs, not a multiple of {QK}: {kind} weights need whole blocks"
                    )
                bias = None if linear.bias is None else linear.bias.detach()
                blocks = quantize(linear.weight.detach(), kind)  # (out, in / 32 * bytes)
                setattr(module, name, BlockLinear(blocks, kind, linear.in_features, bias))


def block_kinds(layer: nn.Module) -> tuple[tuple[str | None, ...], str | None, tuple[str | None, ...], str | None]:
    """The block kinds of a decoder layer's (q, k, v), o, (gate, up) and down weights (None:
    ordinary weights). A group may mix kinds: a Q4_K_M file keeps some v rows in q6_k."""
    attn, mlp = layer.self_attn, layer.mlp
    kind = lambda m: getattr(m, "kind", None)  # noqa: E731
    qkv = (kind(attn.q_proj), kind(attn.k_proj), kind(attn.v_proj))
    return qkv, kind(attn.o_proj), (kind(mlp.gate_proj), kind(mlp.up_proj)), kind(mlp.down_proj)
