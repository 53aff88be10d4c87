"""Recent tokens at 4 bits instead of exact: an age tier for the mixes, emulated on the cached path.

    python bench/tier_ppl.py hamlet 4                                    # W 4, N 896
    python bench/tier_ppl.py --text wikitext-2-raw-test.txt 4
    python bench/tier_ppl.py --text wikitext-2-raw-test.txt 1 --tokens 2048
    python bench/tier_ppl.py hamlet 4 --mix k3v2mixb --residuals 32,64 --tier int8
    python bench/tier_ppl.py hamlet 4 --spec "k2.73=$(minillama kv allocate $M --bits 2.73 --byte-scales | tail -1)"
    python bench/tier_ppl.py hamlet 4 --spec "k2.73=..." --residuals 64 --exact 8 --from-exact   # no double rounding

Keeping the last R tokens exact (the spec's ``residual=R``) instead of 8 takes 30-50% off the
mixes' KLD (docs/quality.md, Frontier XV): the recent tokens carry a large share of the loss,
because that is where the attention looks. An exact token costs 16 bits an element; a tier of
recent tokens coded by a codec TIER would cost its body bits (lm4hb: 4 + 1/8, codes and a
one-byte scale; int8: 8 + 1/2, codes and an fp16 scale and zero per 64). This script measures
what such a tier keeps of the exact window's gain: every row of the residual but the newest E
(`--exact E`, default 0) is coded and decoded with TIER (`--tier`, default lm4hb; in the mix's
own rotated and centered storage space), so the attention reads the tier's values for the R - E
tokens before the newest E; as a token ages out of the residual it is coded again at its layer's
codec from those values (the double rounding a real tier that re-codes would pay; with
`--from-exact` from its exact values instead, as a writer that coded each row for the body when it
entered the tier would). The sinks
stay exact, and the new token's own key and value in its step are exact, as they are today.
No kernel writes these rows (every append takes the PyTorch path, ``LayeredStore.append``); the
attention kernels read the residual as they always do. Bits are computed, not counted: the
cache's own count (the residual at 16 bits) less (R - E) / N x (16 - TIER's body bits).

The tier is built since (``tier=N:CODEC`` in a spec, kv/store.py; docs/quality.md, Frontier
XVI, compares the two); this emulation stays as what Frontier XV measured with, and for tiers a
spec cannot hold (an unrotated ``int8`` tier beside rotated bodies).
"""

from __future__ import annotations

import sys

import torch
from standin import cached_path_rows, text_of  # bench/ is the script's folder, so on sys.path

from minillama.app.default_model import resolve_model
from minillama.kv.codecs import CODECS, FloatCodec
from minillama.kv.layered import LayeredStore
from minillama.kv.spec import MIXES
from minillama.model.loader import load_model

TIER = "lm4hb"  # set by --tier
EXACT = 0  # the newest residual rows kept exact (--exact)


def tiered(store: LayeredStore, rows: torch.Tensor) -> torch.Tensor:
    """Rows (L, B, H, n, D) in storage form -> the same rows coded and decoded by TIER."""
    if isinstance(store.stores[0].codec, FloatCodec):
        return rows
    tier = CODECS[TIER]
    L, B, H, n, D = rows.shape
    flat = rows.reshape(L * B, H, n, D)
    back = tier.decode(tier.encode(flat, D), D, D)  # (L*B, H, n, D) float32
    return back.to(rows.dtype).reshape(L, B, H, n, D)


def code_held(store: LayeredStore, first: int, last: int) -> None:
    """The residual's held rows [first, last) (oldest first) coded and decoded by TIER in place."""
    ring = store.residual
    for a, b in ring.lead._spans(first, last - first) if last > first else []:  # their ring slots
        ring.buf[:, :, :, a:b] = tiered(store, ring.buf[:, :, :, a:b])


_append = LayeredStore.append


def append_through_tier(self: LayeredStore, x: torch.Tensor, evict: int) -> tuple[int, int]:
    """``LayeredStore.append``, then every residual row but the newest EXACT coded by TIER (once:
    ``_tiered`` counts the oldest residual rows already coded, across appends)."""
    ring = self.residual
    before, tiered_before, pushed = ring.lead.count, getattr(self, "_tiered", 0), [0]
    push = ring.push

    def counting(rows: torch.Tensor) -> int:
        pushed[0] += rows.shape[3]
        return push(rows)

    ring.push = counting
    try:
        out = _append(self, x, evict)
    finally:
        del ring.push
    held = ring.lead.count
    done = max(0, tiered_before - (before + pushed[0] - held))  # the coded rows that are still held
    want = max(0, held - EXACT)
    code_held(self, done, want)
    self._tiered = max(done, want)
    return out


def append_coding_the_body_from_exact(self: LayeredStore, x: torch.Tensor, evict: int) -> tuple[int, int]:
    """``append_through_tier`` without the double rounding (``--from-exact``): the residual's held
    rows are put back exact before each append, so a row leaving it is coded into the body from
    its exact values; then every held row but the newest EXACT is coded by TIER again (the same
    values each time: a codec is a function)."""
    ring = self.residual
    if getattr(self, "_exact", None) is not None:
        ring.buf.copy_(self._exact)
    out = _append(self, x, evict)
    self._exact = ring.buf.clone()  # (L, B, H, slots, D): the held rows exact
    code_held(self, 0, ring.lead.count - EXACT)
    return out


def main() -> None:
    global TIER, EXACT
    args = sys.argv[1:]

    def option(name: str, default: str) -> str:
        if name not in args:
            return default
        at = args.index(name)
        value = args[at + 1]
        del args[at : at + 2]
        return value

    mixes = {name: MIXES[name] for name in option("--mix", "k2v2mixb,k3v2mixb").split(",")}
    if "--spec" in args:  # LABEL=SPEC: a mix of one's own (kv allocate's output) instead of the presets
        label, spec = option("--spec", "").split("=", 1)
        mixes = {label: spec}
    residuals = [int(r) for r in option("--residuals", "32,64,128").split(",")]
    tokens = int(option("--tokens", "896"))
    TIER = option("--tier", TIER)
    EXACT = int(option("--exact", "0"))
    from_exact = "--from-exact" in args
    if from_exact:
        args.remove("--from-exact")
    if len(args) < 2:
        sys.exit(__doc__)
    windows = int(args[-1])
    text = text_of(args)
    lm = load_model(resolve_model(None), "float32")
    tier_bits = CODECS[TIER].body_bits(lm.config.head_dim, lm.config.head_dim)  # the mixes' group is a head
    rows = [("fp16", "fp16", 0)]  # (label, spec, the tier's tokens): the exact windows first
    for mix, spec in mixes.items():
        rows.append((f"{mix} (residual 8, exact)", spec, 0))
        rows += [(f"{mix}, residual {r} exact", spec.replace("residual=8", f"residual={r}"), 0) for r in residuals]
    specs = [spec for _, spec, _ in rows]
    exact = cached_path_rows(specs, text, windows, lm, tokens)
    LayeredStore.append = append_coding_the_body_from_exact if from_exact else append_through_tier
    LayeredStore.token_write = lambda self, x: None  # every write through append, and so the tier
    newest = (f", newest {EXACT} exact" if EXACT else "") + (", body from exact" if from_exact else "")
    tier_rows = [
        (f"{mix}, residual {r} as {TIER}{newest}", spec.replace("residual=8", f"residual={r}"), r)
        for mix, spec in mixes.items()
        for r in residuals
    ]
    tier_specs = ["fp16"] + [spec for _, spec, _ in tier_rows]  # fp16 first: the deltas are against a run's first row
    tiers = cached_path_rows(tier_specs, text, windows, lm, tokens)[1:]
    print(f"N {tokens}, W {windows}; bits an element of K and V as a real tier would spend them")
    for row, (label, _, r) in zip(exact + tiers, rows + tier_rows):
        bits = row.bits_per_element - max(0, r - EXACT) / tokens * (16 - tier_bits)
        print(f"  {label:40s} bits {bits:5.3f}  ppl {row.ppl:.4f}  Δ {row.delta_pct:+.2f}%  KLD {row.kld_mean:.5f}")


if __name__ == "__main__":
    main()
