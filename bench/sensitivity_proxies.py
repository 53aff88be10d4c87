"""Can a cache guess, from a prompt's prefill alone, which layers a codec hurts most?

    python bench/sensitivity_proxies.py bench/results/sensitivity_k3v2lm_hamlet_w1.json --dataset hamlet
    python bench/sensitivity_proxies.py MAP.json --text book.txt --prefill 128

A sensitivity map (``minillama ppl --sensitivity --json``) measures, per layer and tensor, the
KLD that quantizing only that tensor costs over the cached path's decode. Choosing each layer's
bits online (issue 28's ``bits=auto``) needs a cheap stand-in computed from the first write. This
script prefills the map's text window (float32, the map's first P tokens) and computes, for the
map's codecs, three such proxies per layer:

* ``recon``: the relative squared error of storing the layer's keys (against their spread over
  tokens) or values (against their energy) -- all the cache itself sees;
* ``attn``: the relative error of the layer's attention output over the prefill when only its
  keys (or values) are stored so -- needs the queries;
* ``fisher``: sum (g * error)^2 with g the gradient of the prefill's own next-token loss with
  respect to the layer's keys (or values) -- one backward pass (KVQuant's and SqueezeLLM's
  Fisher weighting).

and prints each proxy's Spearman rank correlation with the map's per-layer KLD, for keys and for
values. A proxy worth allocating by ranks the layers as the map does (correlation near 1).
"""

from __future__ import annotations

import argparse
import json

import torch

import minillama.model.llama as llama
from minillama.app.options import load, read_text
from minillama.kv.cache import KVCache
from minillama.kv.spec import parse_kv


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0] * len(x)
        for k, i in enumerate(order):
            r[i] = k
        return r

    ra, rb, m = ranks(a), ranks(b), (len(a) - 1) / 2
    return sum((x - m) * (y - m) for x, y in zip(ra, rb)) / sum((x - m) ** 2 for x in ra)


def per_layer_klds(rows: list[dict]) -> dict[str, list[float]]:
    """A sensitivity map's per-layer KLDs in layer order, keys ("k") and values ("v") apart."""
    per = sorted((r for r in rows if r["layer"] is not None), key=lambda r: r["layer"])
    return {t: [r["kld_mean"] for r in per if r["tensor"] == t] for t in "kv"}


def top5(x: list[float]) -> list[int]:
    """The indices of the five largest entries, largest first."""
    return sorted(range(len(x)), key=lambda i: -x[i])[:5]


def stored(codec, x: torch.Tensor, group: int, centered: bool) -> torch.Tensor:
    """x (B, H, T, D) -> what a read of it returns after storing it with `codec`, in model space."""
    y = codec.to_space(x.float())
    mean = y.mean(dim=2, keepdim=True) if centered else torch.zeros_like(y[:, :, :1])
    y = (y - mean).half()
    params = codec.calibrate(y) if codec.per_sequence else None
    back = codec.decode(codec.encode(y, group, params), group, x.shape[-1], params) + mean
    return codec.to_space(back)  # back to model space: H is its own inverse


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of q (B, Hq, T, D) over k, v (B, H, T, D) -> (B, Hq, T, D)."""
    r, t = q.shape[1] // k.shape[1], q.shape[2]
    s = q @ k.repeat_interleave(r, 1).transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, Hq, T, T)
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v.repeat_interleave(r, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("map")
    ap.add_argument("--dataset", default=None)
    ap.add_argument("--text", default=None)
    ap.add_argument("--prefill", type=int, default=128)
    args = ap.parse_args()
    rows = json.loads(open(args.map, encoding="utf-8").read())
    spec = parse_kv(rows[0]["kv"])
    lm = load(None, "float32", "cpu", "reference")  # plain PyTorch: the backward pass reaches every key and value
    ids = lm.tokenizer.encode(read_text(args.text, args.dataset))
    bos = [lm.tokenizer.bos_id] if lm.tokenizer.add_bos else []
    tokens = torch.tensor([bos + ids[: args.prefill]])  # the map's first window starts the same way

    # The harness reaches into the model: each layer's attention call hands over its queries,
    # keys and values, the keys and values as leaves whose gradients the backward pass fills.
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    plain = llama.attend_cache

    def capture(q, k, v, view, rotary, fast):
        k, v = k.detach().requires_grad_(), v.detach().requires_grad_()
        seen.append((q.detach(), k, v))
        return plain(q, k, v, view, rotary, fast)

    llama.attend_cache = capture
    try:
        cache = KVCache.for_model(lm.config, parse_kv("fp32"), capacity=tokens.shape[1] + 1)
        with torch.enable_grad():
            logits = lm.model(tokens, cache)
            torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:], reduction="sum").backward()
    finally:
        llama.attend_cache = plain

    proxies: dict[str, dict[str, list[float]]] = {name: {"k": [], "v": []} for name in ("recon", "attn", "fisher")}
    for layer, (q, k, v) in enumerate(seen):
        (kc, kg, centered), (vc, vg, _) = spec.tensors(layer)
        kh, vh = stored(kc, k.detach(), kg, centered), stored(vc, v.detach(), vg, False)
        o = attention(q, k.detach(), v.detach())
        for t, x, xh, g in (("k", k.detach(), kh, k.grad), ("v", v.detach(), vh, v.grad)):
            ref = x - x.mean(dim=2, keepdim=True) if t == "k" else x
            proxies["recon"][t].append(((xh - x).pow(2).sum() / ref.pow(2).sum()).item())
            oh = attention(q, kh, v.detach()) if t == "k" else attention(q, k.detach(), vh)
            proxies["attn"][t].append(((oh - o).pow(2).sum() / o.pow(2).sum()).item())
            proxies["fisher"][t].append((g * (xh - x)).pow(2).sum().item())

    measured = per_layer_klds(rows)
    print(
        f"map {args.map} ({spec}), prefill {args.prefill} tokens: Spearman rank correlation with the map's KLD per layer"
    )
    print(f"{'proxy':8s} {'keys':>6s} {'values':>7s} {'both':>6s}   top-5 layers (keys | values)")
    for name, p in proxies.items():
        both = spearman(p["k"] + p["v"], measured["k"] + measured["v"])
        keys, values = spearman(p["k"], measured["k"]), spearman(p["v"], measured["v"])
        print(f"{name:8s} {keys:6.2f} {values:7.2f} {both:6.2f}   {top5(p['k'])} | {top5(p['v'])}")
    print(f"{'map':8s} {'':6s} {'':7s} {'':6s}   {top5(measured['k'])} | {top5(measured['v'])}")


if __name__ == "__main__":
    main()
