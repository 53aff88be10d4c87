"""``bits=auto:B``: each layer's K and V codec chosen from the sequence's own prefill.

A per-layer mix written once (``layers=``, made by ``minillama kv allocate`` from sensitivity
maps of one text, kv/allocate.py) spends the bits where that text and that model lose most. An
auto spec chooses instead when its cache receives its first tokens -- the prompt's prefill --
from what those tokens measure, for any model and with no map: every tensor (K or V of a layer)
gets one of ``CANDIDATES``, the average body bits stay within B, and the choice holds until the
cache is reset (a new sequence chooses anew). One cache chooses once for all its rows: a batch
of sequences shares the choice, measured on all of them.

The price of a choice is the *local error* of the decode signal (docs/archive/frontiers.md,
Frontier XX) taken on the prompt instead of the decode, times the layer's *error weight*. For each layer,
tensor and candidate: the prompt's newest ``QUERIES`` queries attend the prompt with that one
tensor of that layer stored by the candidate -- the sinks and the newest ``residual + tier``
tokens before each query exact, as the cache keeps them, the body coded -- and the local error is
the mean squared difference from the exact attention output. Keys and values perturb the same
output, so their prices share one unit. What the rest of the model makes of that error is the
weight handed with the queries (``Probe``; model/auto.py: ``error_weight``): ||W_o||_F^2 over the median squared norm of the residual stream
entering the layer, since the error reaches the stream through o_proj and the next RMSNorm divides
the stream by its norm. Measured against the sensitivity maps of three texts, the local error alone
ranks the layers at Spearman 0.31-0.69 and weighted at 0.80-0.96 (docs/archive/frontiers.md, Frontier XXII);
no constant is fitted. One greedy allocation (kv/allocate.py) then spends the budget over all
tensors.

A prompt too short to have a body for its queries is measured with every token but the sinks
coded. A cache filled without probes (synthetic rows: ``minillama kv``) prices each tensor by its
own reconstruction error instead. These are pure functions; ``KVCache.choose`` calls ``choose``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from minillama.kv.allocate import Choice, allocate
from minillama.kv.codecs import CODECS, Codec
from minillama.kv.write import REFERENCE, Writer

CANDIDATES = ("lm2hb", "lm3hb", "lm4hb")  # every tensor's choices, cheapest first (rotated Lloyd-Max, byte scales)
QUERIES = 32  # the prefill's newest queries that measure the signal
SIGNAL_TOKENS = 2048  # the newest prompt tokens (besides the sinks) a query reads in the signal: its cost is bounded


@dataclass(frozen=True)
class Probe:
    """What the choice is handed for one layer with the first tokens (model/auto.py: probes): the
    layer's newest queries, and how much an error in its attention output weighs."""

    queries: torch.Tensor  # (B, Hq, m, D): the newest m queries, after RoPE (rotated as the stored keys)
    # ||o_proj||_F^2 / the median over the tokens of ||x||^2, x the residual stream entering the layer:
    # an output error e reaches the stream as o_proj(e), and the next RMSNorm divides it by ||x||
    weight: float


def candidates() -> list[Codec]:
    return [CODECS[name] for name in CANDIDATES]


def coded(codec: Codec, y: torch.Tensor, group: int, writer: Writer = REFERENCE) -> torch.Tensor:
    """Rows y (B, H, n, D) in storage space (rotated, centered) -> what a read returns after the
    cache stores them with `codec`: in fp16 as the cache keeps rows before coding them, coded by
    the cache's writer (the same bytes whichever), decoded (float32, still in storage space)."""
    return codec.decode(writer.encode(codec, y.half(), group), group, y.shape[-1])


def exact_mask(positions: torch.Tensor, first: int, sinks: int, window: int) -> torch.Tensor:
    """(m, n) bool: which of the keys at `positions` (n,) each query at first, first+1, ... reads exact:
    the sinks and the newest `window` before it (and itself). When that leaves no coded key a query
    can see (a short prompt), only the sinks are exact."""
    m = int(positions[-1]) + 1 - first
    rows = torch.arange(first, first + m)[:, None]  # (m, 1) query positions
    cols = positions[None, :]  # (1, n)
    exact = (cols < sinks) | (cols >= rows - window)
    if not ((cols <= rows) & ~exact).any():
        exact = (cols < sinks).expand(m, -1)
    return exact


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    exact: torch.Tensor | None = None,
    k_exact: torch.Tensor | None = None,
    v_exact: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (B, Hq, m, D) over k, v (B, H, n, D) where `visible` (m, n) allows -> (B, Hq, m, D), float32.
    Where `exact` (m, n) is True a query reads k_exact, v_exact in place of k, v (its sinks and window).
    The query heads that share a KV head are folded into the query rows, as model/attention.py does."""
    b, hq, m, d = q.shape
    r = hq // k.shape[1]  # query heads per KV head
    qg = q.float().reshape(b, k.shape[1], r * m, d)  # (B, H, r*m, D)
    s = qg @ k.transpose(-1, -2)  # (B, H, r*m, n)
    if exact is not None:
        exact = exact.repeat(r, 1)  # (r*m, n)
        s = torch.where(exact, qg @ k_exact.transpose(-1, -2), s)
    p = (s / d**0.5).masked_fill(~visible.repeat(r, 1), float("-inf")).softmax(-1)  # (B, H, r*m, n)
    if exact is None:
        out = p @ v
    else:
        e = exact.to(p.dtype)
        out = (p * e) @ v_exact + (p * (1 - e)) @ v  # (B, H, r*m, D)
    return out.reshape(b, hq, m, d)


def layer_costs(
    k: torch.Tensor,
    v: torch.Tensor,
    q: torch.Tensor | None,
    groups: tuple[int, int],
    centered: bool,
    sinks: int,
    window: int,
    writer: Writer = REFERENCE,
) -> tuple[list[float], list[float]]:
    """One layer's costs of each candidate for K, then for V (module doc). k, v (B, H, T, D): the
    prompt's keys (after RoPE) and values; q (B, Hq, m, D): its newest m queries, or None.

    Everything is measured in the candidates' shared storage space: H is orthonormal, so scores,
    outputs and squared errors there are those of model space, and each tensor is rotated once."""
    space = candidates()[0]  # every candidate rotates by the same normalized Hadamard matrix
    t = k.shape[2]
    newest = min(t, max(sinks, t - SIGNAL_TOKENS))  # the first of the newest tokens the signal reads
    positions = torch.cat([torch.arange(min(sinks, t)), torch.arange(newest, t)])  # (n,)
    kx = space.to_space(k.float()[:, :, positions])  # (B, H, n, D)
    vx = space.to_space(v.float()[:, :, positions])  # (B, H, n, D)
    # The key center the cache takes from its first append: the mean of every token (B, H, 1, D),
    # in fp16 as the cache keeps it (the mean commutes with the rotation).
    center = space.to_space(k.float().mean(dim=2, keepdim=True)).half().float() if centered else 0.0
    costs: tuple[list[float], list[float]] = ([], [])
    if q is None:  # no queries: each tensor's own reconstruction error over its coded rows
        body = positions >= sinks
        for codec in candidates():
            for out, x, c, g in ((costs[0], kx, center, groups[0]), (costs[1], vx, 0.0, groups[1])):
                err = (coded(codec, x - c, g, writer) + c - x)[:, :, body].pow(2).sum(-1)  # (B, H, body)
                out.append(float(err.mean()) if err.numel() else 0.0)
        return costs
    first = t - q.shape[2]  # the position of the first query
    qx = space.to_space(q.float())  # (B, Hq, m, D)
    exact = exact_mask(positions, first, sinks, window)  # (m, n)
    visible = positions[None, :] <= torch.arange(first, t)[:, None]  # (m, n): causal
    o = attention(qx, kx, vx, visible)  # (B, Hq, m, D): the exact output
    for codec in candidates():
        kq = coded(codec, kx - center, groups[0], writer) + center  # (B, H, n, D)
        vq = coded(codec, vx, groups[1], writer)  # (B, H, n, D)
        for out, kk, vv in ((costs[0], kq, vx), (costs[1], kx, vq)):
            oh = attention(qx, kk, vv, visible, exact, kx, vx)  # (B, Hq, m, D)
            out.append(float((oh - o).pow(2).sum(-1).mean()))
    return costs


def choose(spec, keys: torch.Tensor, values: torch.Tensor, probes: list[Probe] | None, writer: Writer = REFERENCE):
    """The auto spec `spec` (``spec.auto`` = B) with every layer's codecs chosen (``layer_codecs``)
    from the first tokens a cache receives: keys, values (L, B, H, T, D) and, per layer, a Probe: the
    newest queries (B, Hq, m, D) and the weight of an error in the layer's output (or None: module
    doc). The same inputs always give the same choice, and its average body bits never exceed B."""
    head_dim = keys.shape[-1]
    window = spec.residual + spec.tier
    groups = (spec.kgroup, spec.vgroup)
    tensors: list[list[Choice]] = []
    for layer in range(keys.shape[0]):
        q, weight = (None, 1.0) if probes is None else (probes[layer].queries, probes[layer].weight)
        k_costs, v_costs = layer_costs(keys[layer], values[layer], q, groups, spec.center, spec.sinks, window, writer)
        for costs, group in ((k_costs, spec.kgroup), (v_costs, spec.vgroup)):
            tensors.append([Choice(c, c.body_bits(head_dim, group), weight * x) for c, x in zip(candidates(), costs)])
    pick = allocate(tensors, spec.auto)
    chosen = [options[i].codec for options, i in zip(tensors, pick)]
    return replace(spec, layer_codecs=tuple(zip(chosen[0::2], chosen[1::2])))
