"""What ``bits=auto`` measures on the model before its cache chooses its codecs (kv/auto.py).

An auto cache chooses every layer's K and V codec from its first tokens: their keys and values,
each layer's newest queries, and how much an error in each layer's attention output weighs
downstream (``error_weight``). The keys and values reach the cache anyway; the queries and the
weights are the model's, so this module runs the first prefill chunk through the layers once
without a cache, collects them (``probes``) and hands everything to ``cache.choose``. The model
itself knows nothing about it: ``generate.prefill`` calls ``choose_codecs`` before the first
chunk of a cache that is still choosing.
"""

from __future__ import annotations

import torch

from minillama.kv.auto import QUERIES, Probe
from minillama.kv.write import REFERENCE, Writer
from minillama.model.llama import DecoderLayer, Llama
from minillama.model.rope import apply_rope, rope_tables


def error_weight(layer: DecoderLayer, x: torch.Tensor) -> float:
    """How much an error e in this layer's attention output weighs downstream, for x (B, T, hidden)
    the residual stream entering it: e reaches the stream as o_proj(e), about ||W_o||_F^2 ||e||^2
    in squared norm for an error with no preferred direction, and the next RMSNorm divides the
    stream by its norm, so relative to the median token's ||x||^2 (the median leaves out the few
    tokens of massive activations: the BOS)."""
    typical = x.float().pow(2).sum(-1).flatten().median()  # ()
    return float(layer.self_attn.o_proj.weight.float().pow(2).sum() / typical.clamp_min(1e-30))


@torch.inference_mode()
def probes(model: Llama, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[Probe]]:
    """tokens (B, T), the first of a sequence -> their keys and values (L, B, H_kv, T, D) as a cache
    would store them (after RoPE), and per layer a Probe: the newest ``QUERIES`` queries after RoPE
    (B, Hq, m, D) and the layer's error weight."""
    t = tokens.shape[1]
    x = model.model.embed_tokens(tokens)  # (B, T, hidden)
    cos, sin = rope_tables(model.inv_freq, torch.arange(t, device=tokens.device), model.dtype)  # (T, D) each
    keys, values, found = [], [], []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        weight = error_weight(layer, x)
        h = layer.input_layernorm(x[:, -QUERIES:])  # (B, m, hidden): the newest tokens' queries
        q = attn.q_proj(h).reshape(h.shape[0], h.shape[1], attn.hq, attn.d).transpose(1, 2)  # (B, Hq, m, D)
        found.append(Probe(apply_rope(q, cos[-QUERIES:], sin[-QUERIES:]), weight))
        x, (k, v) = layer(x, cos, sin, None, i)
        keys.append(k)
        values.append(v)
    return torch.stack(keys), torch.stack(values), found


def choose_codecs(model: Llama, tokens: torch.Tensor, cache, writer: Writer = REFERENCE) -> None:
    """Let a cache that is still choosing (``cache.choosing``: an auto spec) choose its codecs from
    the first chunk of its sequence, tokens (B, T); `writer` codes the candidates (kv/write.py)."""
    k, v, found = probes(model, tokens)
    cache.choose(k, v, found, writer)
