"""Attention over the cache: the reference path (dequantize, then plain softmax attention).

The new chunk attends to the cached past (read from the cache, possibly quantized)
and to its own exact keys and values, causally. Hadamard codecs store rotated vectors:
for keys the query is rotated instead, since (q H)(k H)^T = q k^T; for values the
weighted sum is taken in rotated space and rotated back once per query,
o = (p V_rot) H, so cached tokens are never un-rotated one by one.

Grouped-query attention: the n_rep query heads that share a KV head are folded into the
query length, so K and V are never copied per query head. Long prompts are attended in
blocks of QUERY_BLOCK queries, so a no-cache forward over 8k tokens never holds an
8k x 8k score matrix per head.

Plain PyTorch throughout: this file is the specification the compiled attention kernels are
tested against (minillama/native/). A caller may hand ``attend`` a ``fused`` function of
(q, k, v) that attends causally with no score matrix in memory -- ``sdpa`` here (PyTorch's
``scaled_dot_product_attention``) or a compiled kernel; tests hold each to the explicit path.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from minillama.kv.codecs import CODECS, Codec, plain_keys
from minillama.kv.interface import LayerView
from minillama.model.rope import RotaryTable, apply_rope

QUERY_BLOCK = 1024  # queries per score matrix: (B, Hkv, n_rep*1024, P+T) floats at most


PLAIN = CODECS["fp32"]  # the identity storage space: keys that are already plain and rotated for their positions


def causal_mask(t_new: int, t_past: int, device) -> torch.Tensor:
    """(T_new, T_past + T_new) bool, True where a query may look: all the past, and itself and earlier."""
    i = torch.arange(t_new, device=device)[:, None]
    j = torch.arange(t_past + t_new, device=device)[None, :]
    return j <= i + t_past


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q (B, Hq, T, D), k and v (B, Hkv, P+T, D) -> (B, Hq, T, D): each query attends the whole past
    and its chunk causally, by PyTorch's fused attention. A first chunk needs no mask in memory:
    SDPA's own causal one (top-left aligned) is the same when P is 0."""
    t, t_past = q.shape[2], k.shape[2] - q.shape[2]
    mask = causal_mask(t, t_past, q.device) if t_past else None  # (T, P+T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)


Fused = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # sdpa's signature


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past: tuple[torch.Tensor, torch.Tensor] | None,
    k_codec: Codec | None,
    v_codec: Codec | None,
    k_center: torch.Tensor | None = None,
    fused: Fused | None = None,
) -> torch.Tensor:
    """q (B, Hq, T, D) and new k, v (B, Hkv, T, D) -> output (B, Hq, T, D).

    ``past`` is the cache's (keys, values), each (B, Hkv, P, D) in the codecs' storage space;
    ``k_center`` (B, Hkv, 1, D) is subtracted from the new keys when the stored ones are centered.
    ``fused`` (``sdpa``'s signature) attends in place of the explicit masked softmax below.
    """
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    out_dtype = q.dtype
    if q.device.type == "cpu":
        # CPUs without bf16/fp16 instructions run those matrix products 10-30x slower than
        # float32: attend in float32 and round the output once.
        q, k, v = q.float(), k.float(), v.float()
        past = None if past is None else (past[0].float(), past[1].float())
    rotated = past is not None and past[0].shape[2] > 0  # with no past, stay in plain space
    if rotated:
        q = k_codec.to_space(q)
        k = k_codec.to_space(k)
        if k_center is not None:
            k = k - k_center.to(k.dtype)  # the same shift as the stored keys: scores move together
        k = torch.cat([past[0], k], dim=2)  # (B, Hkv, P+T, D)
        v = torch.cat([past[1], v_codec.to_space(v)], dim=2)  # (B, Hkv, P+T, D)
    t_past = k.shape[2] - t
    if fused is not None:
        out = fused(q, k, v)  # (B, Hq, T, D)
        if rotated:
            out = v_codec.from_space(out)
        return out.to(out_dtype)
    mask = causal_mask(t, t_past, q.device)  # (T, P+T)
    n_rep = hq // hkv
    qg = q.reshape(b, hkv, n_rep, t, d)  # (B, Hkv, n_rep, T, D): the query heads that share a KV head
    out = torch.empty(b, hkv, n_rep, t, d, dtype=v.dtype, device=v.device)
    for s in range(0, t, QUERY_BLOCK):  # blocks of queries keep the score matrix small for long prompts
        e = min(t, s + QUERY_BLOCK)
        qb = qg[:, :, :, s:e].reshape(b, hkv, n_rep * (e - s), d)  # (B, Hkv, n_rep*T_b, D): heads stacked
        scores = (qb @ k.transpose(-1, -2)) / math.sqrt(d)  # (B, Hkv, n_rep*T_b, P+T)
        scores = scores.masked_fill(~mask[s:e].repeat(n_rep, 1), float("-inf"))
        p = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        out[:, :, :, s:e] = (p @ v).reshape(b, hkv, n_rep, e - s, d)  # (B, Hkv, n_rep, T_b, D)
    if rotated:
        out = v_codec.from_space(out)  # rotate back once per query (H is its own inverse)
    return out.reshape(b, hq, t, d).to(out_dtype)


def attend_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    view: LayerView,
    rotary: RotaryTable | None = None,
    fused: Fused | None = None,
) -> torch.Tensor:
    """New tokens' q (B, Hq, T, D) and k (after RoPE), v (B, Hkv, T, D) against one layer of the
    cache (``cache.layer(i)``). ``rotary`` is given when keys are stored before RoPE.

    Reads the past (dequantized, in storage space) and attends by ``attend``. Keys stored before
    RoPE are first turned back into plain keys and rotated for their positions (``rotary``:
    model/rope.py: RotaryTable)."""
    past_k, past_v = view.read(q.dtype)  # read the past before this step writes anything
    k_codec, v_codec, center = view.k_codec, view.v_codec, view.key_center
    if rotary is not None:  # stored before RoPE: back to plain keys, then rotated for their positions
        cos_k, sin_k = rotary.at(view.positions(q.device))  # (held, D) each
        past_k = apply_rope(plain_keys(past_k, k_codec, center), cos_k, sin_k).to(q.dtype)
        k_codec, center = PLAIN, None
    return attend(q, k, v, (past_k, past_v), k_codec, v_codec, center, fused)
