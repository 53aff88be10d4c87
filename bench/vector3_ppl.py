"""What a 3-bit vector code would do for the values on the cached path, before anyone builds it.

    python bench/vector3_ppl.py hamlet 1          # Hamlet, W 1 (N 896, P 128)
    python bench/vector3_ppl.py --text FILE 1     # any UTF-8 text

Issue 28: at 3.00 bits the values carry 39-47% of the best rows' KLD (docs/quality.md,
``--split``), and a 2-bit vector code (vq2h: four rotated coordinates, one byte) removed a
quarter to 30% of 2-bit values' KLD. This asks what the same idea buys at 3 bits a coordinate:
``vq3d{dim}`` rotates a value row by the Hadamard matrix, scales each group of 64 channels (an
fp16 scale, refined as lm3h's), and replaces every ``dim`` coordinates with the nearest of
2^(3 dim) vectors -- the k-means centroids of seeded N(0, I) samples, never fitted to text
(dim 2: 64 vectors, a book two registers hold; dim 4: 4096). The stand-in keeps the decoded
rows as float32, so the attention reads exactly what such a codec would decode (no kernel reads
it: the step takes the PyTorch path); the bits a real codec would spend are those of lm3h,
3 + 16/64 an element (a code of 3 dim bits per dim channels), computed, not counted by the
cache. The rows: fp16; keys fp16 with values lm3h, vq3d2, vq3d4 (the values alone); then k3v2lm's
keys (lm3h) with each (the values beside 3-bit keys). Also printed: each book's mean squared
error per coordinate on fresh N(0, 1) samples, against the scalar Lloyd-Max book's.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch
from standin import DecodedRows, cached_path_rows, text_of  # bench/ is on sys.path

from minillama.kv.codecs import CODECS
from minillama.kv.quantize import REFINE, _grouped, _nearest, _refined_scale, gaussian_codebook

SAMPLES = 2**17  # k-means samples: 32 per vector of the 4096-vector book
ROUNDS = 20


@functools.lru_cache(maxsize=4)
def book_of(dim: int, bits: int = 3) -> torch.Tensor:
    """2**(bits dim) vectors (n, dim): Lloyd's k-means on SAMPLES seeded N(0, I) samples, started
    from the first n, ROUNDS rounds, rounded to float16 (as gaussian_vector_codebook's)."""
    n = 2 ** (bits * dim)
    x = torch.randn(SAMPLES, dim, generator=torch.Generator().manual_seed(2612))  # (S, dim)
    c = x[:n].clone()
    for _ in range(ROUNDS):
        near = nearest(x, c)
        sums = torch.zeros_like(c).index_add_(0, near, x)
        counts = torch.bincount(near, minlength=n).unsqueeze(1)
        c = torch.where(counts > 0, sums / counts.clamp_min(1), c)
    return c.to(torch.float16).float()


def nearest(x: torch.Tensor, c: torch.Tensor, chunk: int = 1 << 14) -> torch.Tensor:
    """For each row of x (S, dim) the index of the nearest row of c (n, dim): kv/quantize.py's
    _nearest in chunks of rows (its (S, n) distances at once would be 2 GiB for the 4096-vector book)."""
    return torch.cat([_nearest(x[i : i + chunk], c) for i in range(0, len(x), chunk)])


@dataclass(frozen=True)
class Vector3(DecodedRows):
    """A stand-in: Hadamard-rotated values, dim coordinates to the nearest of 2**(3 dim) Gaussian
    vectors times a refined fp16 scale per group, stored decoded."""

    dim: int = 2

    def encode(self, x, group, params=None):
        book = book_of(self.dim)
        xg = _grouped(x.float(), group, "token")  # (..., T, D/G, G) in the rotated space the cache stores

        def chosen(s: torch.Tensor) -> torch.Tensor:  # (..., G) the book's vectors nearest xg / s
            v = (xg / s.float()).reshape(-1, self.dim)
            return book[nearest(v, book)].reshape(xg.shape)

        s = _refined_scale(xg, chosen, REFINE).float()  # (..., T, D/G, 1) fp16 values
        return {"values": (chosen(s) * s).reshape(x.shape)}


def book_error(book: torch.Tensor) -> float:
    """Mean squared error per coordinate of `book` on fresh N(0, I) samples."""
    x = torch.randn(2**16, book.shape[1], generator=torch.Generator().manual_seed(7))
    return ((x - book[nearest(x, book)]) ** 2).mean().item()


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    args = sys.argv[1:]
    windows = int(args[-1])
    text = text_of(args)
    scalar = gaussian_codebook(3).float().unsqueeze(1)  # (8, 1)
    print(f"N(0,1) error per coordinate: lm3 {book_error(scalar):.4f}", end="")
    for dim in (2, 4):
        CODECS[f"vq3d{dim}"] = Vector3(f"vq3d{dim}", 3, "stand-in", rotate=True, dim=dim)
        print(f", vq3d{dim} {book_error(book_of(dim)):.4f}", end="")
    print()
    tail = "group=64,residual=8,sinks=4"
    specs = ["fp16"] + [f"k={k},v={v},{tail}" for k in ("fp16", "lm3h") for v in ("lm3h", "vq3d2", "vq3d4")]
    rows = cached_path_rows(specs, text, windows)
    for r in rows:
        print(f"  {r.kv:44s} ppl {r.ppl:.4f}  Δ {r.delta_pct:+.2f}%  KLD {r.kld_mean:.5f}", flush=True)


if __name__ == "__main__":
    main()
