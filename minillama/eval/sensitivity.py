"""Where a KV scheme loses: one tensor of one layer quantized at a time, the rest exact.

    minillama ppl --dataset hamlet --sensitivity --kv k3v2lm --json --plot k3v2lm.png

For a scheme with L layers this evaluates 2L + 3 variants on the cached path, each a full
cache: layer i's keys (or values) stored with the scheme's codec and every other tensor in
float32, then the keys of every layer alone, the values alone, and the whole scheme. Each
variant gets a perplexity and the mean KL divergence from the exact model, so a row says what
that one tensor costs when nothing else is lost (KVTuner's and KVQuant's per-layer
sensitivity, measured rather than estimated). All variants decode as rows of one batch
(kv/group.py): a step reads the weights once for all 2L + 3 of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from minillama.errors import UserError
from minillama.eval.perplexity import evaluate
from minillama.kv.codecs import CODECS
from minillama.kv.spec import KVSpec
from minillama.model.loader import LoadedModel

EXACT = CODECS["fp32"]


@dataclass(frozen=True)
class Variant:
    layer: int | None  # the quantized layer, or None for the rows over every layer
    tensor: str  # "k", "v", or "all"
    spec: KVSpec


def variants(spec: KVSpec, n_layers: int) -> list[Variant]:
    """Layer by layer, K then V; then K of every layer, V of every layer, and the whole spec."""
    if spec.auto:
        raise UserError(
            f"--sensitivity prices one spec's codecs layer by layer; {spec} chooses them per sequence "
            "(bits=auto): give the codecs with k= and v="
        )
    codecs = [(spec.tensors(i)[0][0], spec.tensors(i)[1][0]) for i in range(n_layers)]  # the spec's (K, V) per layer

    def only(keep: Callable[[int, str], bool], label: str) -> KVSpec:
        layers = tuple((k if keep(i, "k") else EXACT, v if keep(i, "v") else EXACT) for i, (k, v) in enumerate(codecs))
        return replace(spec, layer_codecs=layers, name=f"{spec} {label}")

    out = [
        Variant(layer, t, only(lambda i, u, layer=layer, t=t: i == layer and u == t, f"L{layer}:{t}"))
        for layer in range(n_layers)
        for t in ("k", "v")
    ]
    out.append(Variant(None, "k", only(lambda i, u: u == "k", "K only")))
    out.append(Variant(None, "v", only(lambda i, u: u == "v", "V only")))
    out.append(Variant(None, "all", spec))
    return out


def sensitivity(
    lm: LoadedModel,
    ids: list[int],
    spec: KVSpec,
    n: int = 896,
    prefill: int = 128,
    offset: int = 0,
    windows: int = 1,
    dtype: str = "float32",
    progress: Callable[[str, int], Callable[[int], None]] | None = None,
) -> list[dict]:
    """One row per variant: kv, layer, tensor, kld_mean, ppl (and bits_per_element, delta_pct
    against the exact-cache row that comes first in the run, which is not returned)."""
    parts = variants(spec, lm.config.num_hidden_layers)
    exact = replace(spec, layer_codecs=tuple((EXACT, EXACT) for _ in range(lm.config.num_hidden_layers)), name="exact")
    results = evaluate(
        lm, ids, [exact, *(v.spec for v in parts)], n, prefill, offset, windows, blind=False, dtype=dtype,
        progress=progress,
    )  # fmt: skip
    return [
        {
            "kv": str(spec),
            "layer": v.layer,
            "tensor": v.tensor,
            "kld_mean": r.kld_mean,
            "ppl": r.ppl,
            "delta_pct": r.delta_pct,
            "bits_per_element": r.bits_per_element,
        }
        for v, r in zip(parts, results[1:])
    ]


def format_map(rows: list[dict]) -> str:
    """The per-layer rows as a table (KLD and Δ% for K and V side by side), then the summary rows."""
    kv = rows[0]["kv"]
    by = {(r["layer"], r["tensor"]): r for r in rows}
    layers = sorted({r["layer"] for r in rows if r["layer"] is not None})
    lines = [
        f"sensitivity of {kv}: one tensor of one layer quantized, the rest float32 (KLD from the exact model, nats)",
        f"{'layer':>5}{'K: KLD':>12}{'K: Δppl %':>11}{'V: KLD':>12}{'V: Δppl %':>11}",
    ]
    for i in layers:
        k, v = by[(i, "k")], by[(i, "v")]
        lines.append(
            f"{i:>5}{k['kld_mean']:>12.5f}{k['delta_pct']:>+11.2f}{v['kld_mean']:>12.5f}{v['delta_pct']:>+11.2f}"
        )
    for key, label in (((None, "k"), "K of every layer"), ((None, "v"), "V of every layer"), ((None, "all"), kv)):
        r = by[key]
        lines.append(f"{label:<24}KLD {r['kld_mean']:.5f}  ppl {r['ppl']:.4f} ({r['delta_pct']:+.2f}%)")
    return "\n".join(lines)


def plot_map(rows: list[dict], path: str) -> None:
    """A heatmap: layers down, K and V across, colour = mean KLD (log scale)."""
    import numpy as np

    from minillama.eval.pyplot import pyplot

    plt = pyplot()
    from matplotlib.colors import LogNorm

    layers = sorted({r["layer"] for r in rows if r["layer"] is not None})
    grid = np.array(
        [[max(r["kld_mean"], 1e-7) for t in "kv" for r in rows if r["layer"] == i and r["tensor"] == t] for i in layers]
    )
    fig, ax = plt.subplots(figsize=(3.6, 0.22 * len(layers) + 1.6))
    image = ax.imshow(grid, aspect="auto", cmap="magma_r", norm=LogNorm())
    ax.set_xticks([0, 1], ["K", "V"])
    ax.set_yticks(range(len(layers)), [str(i) for i in layers], fontsize=6)
    ax.set_ylabel("layer")
    ax.set_title(f"{rows[0]['kv']}: KLD per tensor", fontsize=8)
    fig.colorbar(image, ax=ax, label="mean KL(exact || cached), nats")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
