"""The bytes of a cache, measured: a spec's budget (a real cache filled with synthetic K/V) and
a saved cache file's contents, both counted by the cache's own counters.

``minillama kv SPEC --tokens N`` and ``minillama kv inspect FILE`` print these. The
measurement is the truth (the cache counts the bytes it holds); ``kv/budget.py`` has the
closed form the tests hold it to.
"""

from __future__ import annotations

from minillama.eval.synthetic import fill_synthetic
from minillama.kv.cache import KVCache
from minillama.kv.file import read, restore
from minillama.kv.spec import KVSpec
from minillama.native.write import writer


def byte_budget(n_layers: int, n_kv_heads: int, head_dim: int, spec: KVSpec, tokens: int) -> str:
    """A printable budget of `spec` for a model of these sizes at `tokens` tokens, measured from a real cache."""
    cache = KVCache(spec, n_layers, n_kv_heads, head_dim, capacity=max(tokens, spec.min_capacity))
    fill_synthetic(cache, tokens, writer=writer())  # the kernels write it where they run
    live = cache.live_bytes()
    fp16 = n_layers * 2 * n_kv_heads * head_dim * tokens * 2
    per_tok = sum(live.values()) / tokens / n_layers / n_kv_heads
    codecs = f"k={spec.k.name} v={spec.v.name}"
    if spec.auto:  # the synthetic rows choose without queries: each tensor by its reconstruction error
        codecs = f"{cache.spec.auto_state(head_dim, n_layers)} from synthetic rows (a real prompt chooses its own)"
    lines = [
        f"kv {spec}: {codecs} kgroup={spec.kgroup} vgroup={spec.vgroup} residual={spec.residual} "
        f"sinks={spec.sinks}"
        + (" center=1" if spec.center else "")
        + (" rope=pre" if spec.rope == "pre" else "")
        + (" positions=cache" if spec.positions == "cache" else "")
        + (f" start={spec.start}" if spec.start else "")
        + (f" tier={spec.tier}:{spec.tier_codec.name}" if spec.tier else "")
        + (f"; layers: {spec.layer_mix()}" if spec.layer_codecs else ""),
        f"model: {n_layers} layers x {n_kv_heads} KV heads x head_dim {head_dim}; {tokens} tokens",
        *(f"  {k:<9}{v:>14,d} bytes" for k, v in live.items()),
        f"  {'live':<9}{sum(live.values()):>14,d} bytes ({sum(live.values()) / 2**20:.2f} MiB, {sum(live.values()) / fp16:.1%} of fp16)",
        f"  {'allocated':<9}{cache.allocated_bytes():>14,d} bytes (capacity {cache.capacity} tokens)",
        f"  bits/element {cache.bits_per_element():.3f}; {per_tok:.1f} bytes per token per KV head (K+V)",
    ]
    return "\n".join(lines)


def inspect_file(path: str) -> dict:
    """What a saved cache file holds (``minillama kv inspect``): its spec, model, tokens, positions,
    evictions, and the bytes of every layer's parts, counted by the cache rebuilt from it (so the
    numbers are the ones ``/stats`` showed for that state)."""
    saved = read(path)
    cache = restore(saved, None)
    h = saved.header
    layers = []
    for i, pair in enumerate(cache.layers):
        row = {"layer": i}
        for name, store in zip(("k", "v"), pair):
            live = store.live_bytes()
            row[name] = {
                "codec": store.codec.name,
                "sinks": live["sinks"],
                "body": live["codes"] + live["scales"],
                "residual": live["residual"],
                "body_tokens": store.n_body,
                "tier_tokens": store.n_tier,
            }
        layers.append(row)
    positions = saved.tensors["positions"].tolist()
    live = cache.live_bytes()
    return {
        "path": str(path),
        "kv": h["kv_name"],
        "kv_spec": h["kv"],
        "model": h["model"]["name"],
        "model_dtype": h["model"]["dtype"],
        "tokens": cache.held,
        "tokens_fed": cache.position,
        "positions": [positions[0], positions[-1]] if positions else [],
        "evicted": cache.evicted,
        "cache_bytes": sum(live.values()),
        "live_bytes": live,
        "bits_per_element": cache.bits_per_element() if cache.held else None,
        "file_bytes": saved.file_bytes,
        "layers": layers,
    }


def format_inspect(info: dict) -> str:
    bits = "-" if info["bits_per_element"] is None else f"{info['bits_per_element']:.3f}"
    lines = [
        f"{info['path']}: kv {info['kv']} ({info['kv_spec']})",
        f"model {info['model']} ({info['model_dtype']} weights); {info['tokens']} tokens held of "
        f"{info['tokens_fed']} fed, positions {'-'.join(map(str, info['positions'])) or '-'}, "
        f"{info['evicted']} evicted",
        "live bytes: "
        + ", ".join(f"{k} {v:,}" for k, v in info["live_bytes"].items())
        + f"; total {info['cache_bytes']:,}; effective bits/element {bits}",
        f"file: {info['file_bytes']:,} bytes ({info['file_bytes'] - info['cache_bytes']:,} besides the cache: "
        "header, token ids, positions, last logits)",
        f"{'layer':>5}  {'K codec':<8}{'sinks':>9}{'body':>11}{'residual':>10}  {'V codec':<8}{'sinks':>9}"
        f"{'body':>11}{'residual':>10}",
    ]
    for row in info["layers"]:
        k, v = row["k"], row["v"]
        lines.append(
            f"{row['layer']:>5}  {k['codec']:<8}{k['sinks']:>9,}{k['body']:>11,}{k['residual']:>10,}  "
            f"{v['codec']:<8}{v['sinks']:>9,}{v['body']:>11,}{v['residual']:>10,}"
        )
    return "\n".join(lines)
