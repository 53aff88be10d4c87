"""A 1-bit QJL residual sign sketch for the keys (issue 28, item 4): emulated on the cached path.

    python bench/qjl_keys_ppl.py hamlet 1          # keys only, Hamlet W 1 (N 896, P 128)
    python bench/qjl_keys_ppl.py --text FILE 1     # any UTF-8 text
    python bench/qjl_keys_ppl.py --gauge           # the score errors on Gaussian rows only

TurboQuant's inner-product quantizer (arXiv 2504.19874) codes a vector with b Lloyd-Max bits
and spends one more bit a coordinate on the residual r = k - k_b: the signs of S r for a seeded
Gaussian matrix S (D x D) and the norm |r|. Its estimate of q . r is sqrt(pi/2) / D |r| (S q) .
sign(S r), unbiased, which is the same as adding r_hat = sqrt(pi/2) / D |r| S' sign(S r) to the
decoded key: so a stand-in that stores the decoded rows reproduces every score exactly.

``qjl{b}`` (rotated by the Hadamard matrix as lm{b}h, scale per group refined as lm{b}h's, then
the sketch of the residual) keeps the decoded key as float32; no kernel reads it (the step takes
the PyTorch path). Bits an element: b + 16/64 (codes, scale) + 1 + 16/64 (the signs, an fp16
norm a row of 64), computed, not counted by the cache. ``lm{b}u`` asks what the sketch's one
good property is worth without its bit: Lloyd-Max centroids shrink a key toward 0 (the scores'
slope on the true ones ~1 - the book's error, 0.89 at 2 bits), the sketch removes that on
average; lm{b}u divides the lm{b}h decode by that slope, measured once on seeded Gaussian rows
(data-free), at lm{b}h's bits. Rows: fp16; keys lm2h, lm2u, qjl2, lm3h, lm3u, qjl3, lm4h; values
fp16 throughout (the keys alone; centered keys, group 64, residual 8, 4 sinks).

``--gauge`` first prints what theory says: on N(0, I) rows of 64 and random queries, the mean
squared score error of lm{b} with and without the sketch. The sketch's variance is pi / (2 D)
|q|^2 |r|^2, against |q|^2 |r|^2 / D for the residual left out: unbiased, but 1.57x the error
of not sketching at all, while a (b + 1)-th Lloyd-Max bit divides it by ~3.4.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass

import torch
from standin import DecodedRows, cached_path_rows, text_of  # bench/ is on sys.path

from minillama.kv.codecs import CODECS
from minillama.kv.quantize import dequantize_codebook, quantize_codebook

KEYS_ONLY = "v=fp16,group=64,residual=8,sinks=4,center=1"


@functools.lru_cache(maxsize=2)
def sketch_matrix(d: int) -> torch.Tensor:
    """S (d, d): seeded N(0, 1) entries, the same for every row, layer and head (never fitted)."""
    return torch.randn(d, d, generator=torch.Generator().manual_seed(2504))


def with_sketch(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """x (..., D) -> its lm{bits} decode plus the QJL estimate of the residual, float32."""
    codes, scale = quantize_codebook(x, bits, group)
    mse = dequantize_codebook(codes, scale, bits, group).float()  # (..., D)
    r = x.float() - mse
    s = sketch_matrix(x.shape[-1])  # (D, D)
    signs = torch.where(r @ s.T >= 0, 1.0, -1.0)  # (..., D): one bit a coordinate
    norm = r.norm(dim=-1, keepdim=True).to(torch.float16).float()  # (..., 1): an fp16 a row
    return mse + norm * math.sqrt(math.pi / 2) / x.shape[-1] * (signs @ s)


@functools.lru_cache(maxsize=4)
def shrink(bits: int, d: int = 64) -> float:
    """The slope of lm{bits}'s scores on the true ones, q . k_hat against q . k, on seeded N(0, I)
    rows (~1 - the Lloyd-Max error: the centroids shrink a key toward 0); data-free."""
    g = torch.Generator().manual_seed(11)
    k, q = torch.randn(1 << 14, d, generator=g), torch.randn(1 << 14, d, generator=g)
    codes, scale = quantize_codebook(k, bits, d)
    true, est = (q * k).sum(dim=1), (q * dequantize_codebook(codes, scale, bits, d).float()).sum(dim=1)
    return ((est * true).sum() / (true * true).sum()).item()


@dataclass(frozen=True)
class Qjl(DecodedRows):
    """A stand-in: lm{bits}h keys plus a 1-bit sign sketch of their residual (or, `unshrunk`, no
    sketch but the decoded key divided by shrink(bits): the same mean slope, no bit), stored decoded."""

    unshrunk: bool = False

    def encode(self, x, group, params=None):
        if self.unshrunk:
            codes, scale = quantize_codebook(x, self.bits, group)
            return {"values": dequantize_codebook(codes, scale, self.bits, group).float() / shrink(self.bits)}
        return {"values": with_sketch(x, self.bits, group)}


def gauge(d: int = 64, rows: int = 1 << 14) -> None:
    """Mean squared score error q . (k - k_hat) on N(0, I) keys and queries, per |q|^2 |k|^2 / d."""
    g = torch.Generator().manual_seed(7)
    k, q = torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g)
    unit = (q.norm(dim=1) ** 2 * k.norm(dim=1) ** 2 / d).mean()
    for bits in (2, 3, 4):
        codes, scale = quantize_codebook(k, bits, d)
        plain = dequantize_codebook(codes, scale, bits, d).float()
        for name, hat in ((f"lm{bits}", plain), (f"lm{bits} + sketch", with_sketch(k, bits, d))):
            true, est = (q * k).sum(dim=1), (q * hat).sum(dim=1)
            err = ((true - est) ** 2).mean() / unit
            slope = (est * true).sum() / (true * true).sum()  # 1: the scores not shrunk on average
            print(f"  {name:16s} score error {err.item():.5f}  slope of the scores {slope.item():.4f}")


def main() -> None:
    args = sys.argv[1:]
    if args == ["--gauge"]:
        gauge()
        return
    if len(args) < 2:
        sys.exit(__doc__)
    windows = int(args[-1])
    text = text_of(args)
    gauge()
    for bits in (2, 3):
        CODECS[f"qjl{bits}"] = Qjl(f"qjl{bits}", bits, "stand-in", rotate=True)
        CODECS[f"lm{bits}u"] = Qjl(f"lm{bits}u", bits, "stand-in", rotate=True, unshrunk=True)
    print("shrink: " + ", ".join(f"lm{b} {shrink(b):.4f}" for b in (2, 3)))
    keys = {"lm2h": 2.25, "lm2u": 2.25, "qjl2": 3.5, "lm3h": 3.25, "lm3u": 3.25, "qjl3": 4.5, "lm4h": 4.25}
    specs = ["fp16"] + [f"k={k},{KEYS_ONLY}" for k in keys]
    rows = cached_path_rows(specs, text, windows)
    for r, bits in zip(rows, [16.0, *keys.values()]):
        print(
            f"  {r.kv:48s} keys {bits:5.2f} bits  ppl {r.ppl:.4f}  Δ {r.delta_pct:+.2f}%  KLD {r.kld_mean:.5f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
