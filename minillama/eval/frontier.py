"""The bits-vs-quality frontier: cached-path perplexity against effective bits/element.

``minillama ppl --frontier`` evaluates every preset; this module draws them with the
peers measured by ``bench/peers.py`` (transformers quanto, llama.cpp) on the same axes.
Peer bits are their nominal storage cost (quanto int4/int2 at group 32 with an fp16
scale and zero: 5.0 / 3.0 bits; llama.cpp q8_0 8.5, q4_0 4.5, f16 16).
``plot_buckets`` draws the other picture ``ppl`` can give: perplexity per range of positions
(``--bucket``), the streaming curve of a cache that evicts (``--ctx``).
"""

from __future__ import annotations

import json
from pathlib import Path

from minillama.errors import UserError
from minillama.eval.perplexity import PplResult
from minillama.eval.pyplot import pyplot

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


def plot_buckets(rows: list[dict], path: str, trained: int | None = None) -> None:
    """Perplexity per bucket of positions, one line per scheme (rows as ``PplResult.to_dict()``
    gives them, so a saved ``--json`` can be drawn again); a dashed line marks the model's
    trained context (``trained``) and a dotted one where the cache first evicted."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    for r in rows:
        buckets = r.get("buckets") or []
        if not buckets:
            raise UserError("a streaming plot needs --bucket")
        ax.plot([(b["start"] + b["end"]) / 2 for b in buckets], [b["ppl"] for b in buckets], marker="o", label=r["kv"])
        first_evicted = next((b["start"] for b in buckets if b["evicted"]), None)
        if first_evicted is not None:
            ax.axvline(first_evicted, color="gray", linestyle=":", linewidth=1)
    if trained:
        ax.axvline(trained, color="black", linestyle="--", linewidth=1, label=f"trained context ({trained})")
    r0 = rows[0]
    ax.set_xlabel("position of the predicted token")
    ax.set_ylabel("cached-path perplexity per bucket")
    ax.set_title(f"{r0['model']}: cache of {r0.get('ctx') or r0['tokens']} tokens, window {r0['tokens']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot(results: list[PplResult], path: str, peers: list[tuple[str, float, float]], y: str = "ppl") -> None:
    """ppl (or mean KLD, y="kld") against effective bits, every scheme and the peers' points; left the
    whole range, right a zoom on the points within 5% of the best perplexity (KLD: below 0.05 nats)."""
    plt = pyplot()
    r0 = results[0]
    if y == "kld" and any(r.kld_mean is None for r in results):
        raise UserError("a KLD plot needs the exact model's logits: they are not computed with --ctx below the window")
    value = (
        (lambda r: r.ppl) if y == "ppl" else (lambda r: max(r.kld_mean, 1e-7))
    )  # fp32's KLD is ~0: keep it on a log axis
    zoomed = (lambda v: v <= min(value(r) for r in results) * 1.05) if y == "ppl" else (lambda v: v <= 0.05)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, zoom in zip(axes, (False, True)):
        for r in results:
            if zoom and not zoomed(value(r)):
                continue
            ax.scatter(r.bits_per_element, value(r), color="tab:blue", zorder=3)
            ax.annotate(r.kv, (r.bits_per_element, value(r)), fontsize=7, xytext=(3, 3), textcoords="offset points")
        for label, bits, ppl in peers:
            if zoom and not zoomed(ppl):
                continue
            ax.scatter(bits, ppl, color="tab:red", marker="x", zorder=3)
            ax.annotate(label, (bits, ppl), fontsize=7, color="tab:red", xytext=(3, -9), textcoords="offset points")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("effective bits per element (scales, zeros, residual, sinks included)")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("cached-path perplexity" if y == "ppl" else "mean KL(exact || cached), nats")
    axes[0].set_title(f"{r0.model}: {r0.windows} x {r0.tokens} tokens, prefill {r0.prefill}")
    axes[1].set_title(
        "zoom: within 5% of the best (blue: minillama, red: peers)" if y == "ppl" else "zoom: mean KLD below 0.05 nats"
    )
    if y == "kld":
        axes[1].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
