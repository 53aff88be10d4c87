"""Is there an online signal for where a codec hurts? Each layer's attention error over the decode.

    python bench/decode_signal.py bench/results/sensitivity_k3v2lm_hamlet_w1.json hamlet \\
        wikitext2@wikitext-2-raw-test.txt=bench/results/sensitivity_k3v2lm_wikitext2_w1.json \\
        pydoc=bench/results/sensitivity_k3v2lm_pydoc_w1.json
    python bench/decode_signal.py MAP.json hamlet wikitext2@FILE --write DIR   # predicted maps, for kv allocate

The sensitivity maps (``minillama ppl --sensitivity``) rank the layers alike on every text except
for a few tensors whose cost belongs to the text: on wikitext-2 layer 18's values, on pydoc layer
10's keys (docs/quality.md, Frontier XIX). The prefill stand-ins of bench/sensitivity_proxies.py
miss both. This asks whether the decode itself carries the signal: for each text's first window
(N tokens, the maps' window, the BOS in front) it runs the exact model once, captures every
layer's queries, keys and values, and computes each layer's **local error**: the mean (``--stat``:
or another statistic) over the decode positions P..N-1 and the query heads of the squared
difference between the layer's attention output read from exact keys and values and read from
the cache as the map's spec would hold it (the sinks and the newest `residual` tokens exact, the
body stored by the layer's codec; centered keys take their center from the whole window, as
bench/sensitivity_proxies.py's `stored` does), keys and values apart. A cache could measure this
online (its residual rows are exact before they are coded).

A local error is not a KLD: what a layer's error costs downstream is a gain of the model's. With
the first text's map as the calibration, gain[l] = KLD[l] / local[l], and the other texts' maps
are predicted as gain[l] x local_text[l] (``--write DIR``: as maps ``kv allocate`` reads). It
prints, per text with a map and tensor, the Spearman correlation with the text's own map of (a)
the local error alone (with ``--weighted``, times each layer's error weight as a ``bits=auto``
cache prices it: ||W_o||^2 over the median token's squared stream norm over the prefill,
kv/auto.py), (b) the calibrated prediction, (c) the calibration text's map itself (the
offline allocation's assumption), and the top five layers of each: a signal worth allocating by
beats (c) and finds the text's own hot spots; then each layer's local error and KLD as ratios to
the calibration text's.

A TEXT is ``NAME[@FILE][=MAP]``: a --dataset name (or a name for the text file FILE), and its
map if it has one; the first is the calibration text, whose map is the positional MAP.
"""

from __future__ import annotations

import argparse
import json

import torch
from sensitivity_proxies import per_layer_klds, spearman, stored, top5  # bench/ is the script's folder, so on sys.path

import minillama.model.llama as llama
from minillama.app.options import load, read_text
from minillama.kv.cache import KVCache
from minillama.kv.spec import parse_kv


def cached_attention(q, k, v, kq, vq, first: int, sinks: int, residual: int) -> torch.Tensor:
    """Attention of the decode queries q[:, :, first:] (B, Hq, T, D) over keys and values as the
    cache holds them when each query is the new token: positions below `sinks` and the newest
    `residual` before it, and itself, from k, v; the body between them from kq, vq ->
    (B, Hq, T - first, D)."""
    r, t = q.shape[1] // k.shape[1], q.shape[2]
    rows = torch.arange(first, t)[:, None]  # (T', 1) query positions
    cols = torch.arange(t)[None, :]  # (1, T) key positions
    exact = (cols < sinks) | (cols >= rows - residual)  # (T', T): sinks, residual, the token itself
    scale = q.shape[-1] ** -0.5
    qd = q[:, :, first:]  # (B, Hq, T', D)
    kx, kb = k.repeat_interleave(r, 1), kq.repeat_interleave(r, 1)  # (B, Hq, T, D)
    vx, vb = v.repeat_interleave(r, 1), vq.repeat_interleave(r, 1)
    s = torch.where(exact, qd @ kx.transpose(-1, -2), qd @ kb.transpose(-1, -2)) * scale  # (B, Hq, T', T)
    s = s.masked_fill(cols > rows, float("-inf"))
    p = s.softmax(-1)  # (B, Hq, T', T)
    e = exact.to(p.dtype)
    return (p * e) @ vx + (p * (1 - e)) @ vb  # the exact rows' values, and the body's coded ones


def local_errors(
    lm, ids: list[int], spec, n: int, first: int, stat: str = "mean", weighted: bool = False
) -> dict[str, list[float]]:
    """Per layer, keys and values apart: the `stat` (STATS) of each decode query's squared
    attention-output error (module doc); with `weighted`, times the layer's error weight as the
    model hands it to a bits=auto cache (``DecoderLayer.error_weight`` of the prefill's stream)."""
    bos = [lm.tokenizer.bos_id] if lm.tokenizer.add_bos else []
    tokens = torch.tensor([bos + ids[:n]])  # (1, N+1): the maps' first window
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    plain = llama.attend_cache

    def capture(q, k, v, view, rotary, fast):
        seen.append((q, k, v))
        return plain(q, k, v, view, rotary, fast)

    weights: list[float] = []  # each layer's error weight, from the stream over the prefill's tokens
    hooks = [
        layer.register_forward_pre_hook(
            lambda mod, args: weights.append(mod.error_weight(args[0][:, : first + len(bos)]))
        )
        for layer in lm.model.model.layers
    ]
    llama.attend_cache = capture
    try:
        cache = KVCache.for_model(lm.config, parse_kv("fp32"), capacity=tokens.shape[1] + 1)
        lm.model(tokens, cache)
    finally:
        llama.attend_cache = plain
        for h in hooks:
            h.remove()
    out: dict[str, list[float]] = {"k": [], "v": []}
    start = first + len(bos)  # the first decode position (the first scored prediction's query)
    for layer, (q, k, v) in enumerate(seen):
        (kc, kg, centered), (vc, vg, _) = spec.tensors(layer)
        kh, vh = stored(kc, k, kg, centered), stored(vc, v, vg, False)
        o = cached_attention(q, k, v, k, v, start, spec.sinks, spec.residual)
        for t, kq, vq in (("k", kh, v), ("v", k, vh)):
            oh = cached_attention(q, k, v, kq, vq, start, spec.sinks, spec.residual)
            err = (oh - o).pow(2).sum(-1)  # (B, Hq, T'): each query's squared error
            out[t].append(STATS[stat](err, o).item() * (weights[layer] if weighted else 1.0))
    return out


# How a layer's per-query squared errors (B, Hq, T') become one number (--stat)
STATS = {
    "mean": lambda err, o: err.mean(),
    "relative": lambda err, o: (err / o.pow(2).sum(-1)).mean(),
    "p99": lambda err, o: err.flatten().quantile(0.99),
    "max": lambda err, o: err.max(),
}


def predicted_map(rows: list[dict], pred: dict[str, list[float]], text: str) -> list[dict]:
    """The calibration map's per-layer rows with each KLD replaced by the prediction for `text`
    (ppl and delta_pct dropped: not measured), a map ``minillama kv allocate --map`` reads."""
    out = []
    for r in rows:
        if r["layer"] is not None:
            out.append(
                {
                    "kv": r["kv"],
                    "layer": r["layer"],
                    "tensor": r["tensor"],
                    "kld_mean": pred[r["tensor"]][r["layer"]],
                    "predicted_for": text,
                    "bits_per_element": r["bits_per_element"],
                }
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("map", help="the calibration text's sensitivity map (its spec is the one measured)")
    ap.add_argument("texts", nargs="+", help="NAME[@FILE][=MAP]: the calibration text first, then others")
    ap.add_argument("--tokens", type=int, default=896)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--stat", choices=sorted(STATS), default="mean", help="a layer's number from its queries' errors")
    ap.add_argument("--write", metavar="DIR", help="write each other text's predicted map there")
    ap.add_argument(
        "--weighted", action="store_true", help="each layer's local error times its error weight (bits=auto's price)"
    )
    args = ap.parse_args()
    cal_rows = json.loads(open(args.map, encoding="utf-8").read())
    spec = parse_kv(cal_rows[0]["kv"])
    lm = load(None, "float32", "cpu", "reference")
    texts = []
    for i, arg in enumerate(args.texts):
        head, _, path = arg.partition("=")
        name, _, file = head.partition("@")
        ids = lm.tokenizer.encode(read_text(file or None, None if file else name))
        with torch.inference_mode():
            local = local_errors(lm, ids, spec, args.tokens, args.prefill, args.stat, args.weighted)
        rows = cal_rows if i == 0 else json.loads(open(path, encoding="utf-8").read()) if path else None
        texts.append((name, per_layer_klds(rows) if rows else None, local))
        print(f"{name}: local errors computed ({len(local['k'])} layers)", flush=True)
    cal_name, cal_map, cal_local = texts[0]
    gain = {t: [m / max(e, 1e-30) for m, e in zip(cal_map[t], cal_local[t])] for t in "kv"}
    print(
        f"\n{cal_rows[0]['kv']}, N {args.tokens}, P {args.prefill}, {args.stat} of the queries' errors; gains from {cal_name}'s map"
    )
    print(
        f"{'text':10s} {'tensor':6s} {'local':>6s} {'pred':>6s} {'calmap':>7s}   top 5: map | local | pred | calibration map"
    )
    for i, (name, kmap, local) in enumerate(texts):
        pred = {t: [g * e for g, e in zip(gain[t], local[t])] for t in "kv"}
        if args.write and i:  # every text but the calibration one
            out = f"{args.write}/{args.map.rsplit('/', 1)[-1].removesuffix('.json')}_predicted_{name}.json"
            with open(out, "w", encoding="utf-8") as f:
                json.dump(predicted_map(cal_rows, pred, name), f, indent=1)
            print(f"{name}: predicted map written to {out}")
        if kmap is None:
            continue
        for t in "kv":
            print(
                f"{name:10s} {t:6s} {spearman(local[t], kmap[t]):6.2f} {spearman(pred[t], kmap[t]):6.2f} "
                f"{spearman(cal_map[t], kmap[t]):7.2f}   {top5(kmap[t])} | {top5(local[t])} | {top5(pred[t])} | {top5(cal_map[t])}"
            )
    print("\nper layer: the local error's ratio to the calibration text's, and the map's ratio")
    for name, kmap, local in texts[1:]:
        if kmap is None:
            continue
        for t in "kv":
            lr = [a / b for a, b in zip(local[t], cal_local[t])]
            mr = [a / max(b, 1e-30) for a, b in zip(kmap[t], cal_map[t])]
            print(f"{name} {t}: Spearman of the ratios {spearman(lr, mr):.2f}")
            print("  " + " ".join(f"{i}:{a:.1f}/{b:.1f}" for i, (a, b) in enumerate(zip(lr, mr))))


if __name__ == "__main__":
    main()
