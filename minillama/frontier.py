"""The bits-vs-quality frontier: cached-path perplexity against effective bits/element.

``minillama ppl --frontier`` evaluates every preset; this module draws them with the
peers measured by ``bench/peers.py`` (transformers quanto, llama.cpp) on the same axes.
Peer bits are their nominal storage cost (quanto int4/int2 at group 32 with an fp16
scale and zero: 5.0 / 3.0 bits; llama.cpp q8_0 8.5, q4_0 4.5, f16 16).
"""

from __future__ import annotations

import json
from pathlib import Path

from minillama.errors import UserError
from minillama.perplexity import PplResult

PEER_BITS = {"quanto4": 5.0, "quanto2": 3.0}


def load_peers(path: Path) -> list[tuple[str, float, float]]:
    """(label, bits, ppl) for each peer row in a bench/peers.py JSON file, if it exists."""
    if not path.exists():
        return []
    points = []
    for row in json.loads(path.read_text()):
        kind = row["peer"].split("-")[1]
        bits = PEER_BITS.get(kind, row.get("kv_bits"))
        if row.get("ppl") is not None and bits is not None:
            points.append((row["peer"], float(bits), float(row["ppl"])))
    return points


def plot(results: list[PplResult], path: str, peers: list[tuple[str, float, float]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'minillama[bench]'") from None
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        ax.scatter(r.bits_per_element, r.ppl, color="tab:blue", zorder=3)
        ax.annotate(r.kv, (r.bits_per_element, r.ppl), fontsize=7, xytext=(3, 3), textcoords="offset points")
    for label, bits, ppl in peers:
        ax.scatter(bits, ppl, color="tab:red", marker="x", zorder=3)
        ax.annotate(label, (bits, ppl), fontsize=7, color="tab:red", xytext=(3, -9), textcoords="offset points")
    r0 = results[0]
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("effective bits per element (scales, zeros, residual, sinks included)")
    ax.set_ylabel("cached-path perplexity")
    ax.set_title(f"{r0.model}: {r0.windows} x {r0.tokens} tokens, prefill {r0.prefill} (blue: minillama, red: peers)")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
