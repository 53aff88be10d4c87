"""Quantizers as pure functions: ``quantize(x) -> codes, scale, zero`` and ``dequantize``.

Nothing here knows about caches or models; the cache calls these. All inputs are
float tensors whose last two dimensions are (tokens, channels) = (T, D).

Asymmetric uniform (min-max) quantization, as in KIVI (Liu et al. 2024):
    scale = (max - min) / (2**b - 1),  zero = min,  code = round((x - zero) / scale)
with scale and zero stored as float16 per group. Effective bits per element at group G:
    b + 2 * 16 / G     (int4, G=32: 5.0 bits; int2, G=32: 3.0 bits)
Groups run either along channels of one token (``axis="token"``, G consecutive channels
share a scale) or along time for one channel (``axis="channel"``, G consecutive tokens
share a scale: KIVI's per-channel keys, which keeps outlier channels from spoiling the
others).

Ternary (1.58-bit) uses the ternary-weight-network rule (Li et al. 2016): threshold
t = 0.7 * mean|x| over the group, code = sign(x) where |x| > t else 0, and a symmetric
fp16 scale = mean|x| over the kept entries, which minimises the squared error for that
support. Effective bits: 8/5 (five trits per byte) + 16 / G.

Codebook (Lloyd-Max) quantization, as in TurboQuant (Zandieh et al. 2025): after a
Hadamard rotation the coordinates of a vector are close to Gaussian, so instead of a
uniform grid we use the 2**b-level Lloyd-Max quantizer of N(0, 1) (the levels that
minimise the expected squared error of a standard Gaussian), scaled per group by the
group's RMS (fp16). Nothing is fitted to text: the codebook is a property of the Gaussian.
Effective bits: b + 16 / G, or b + 8 / G with one-byte log-coded scales (``lm*b``).

Vector codes: the same rotated, near-Gaussian coordinates taken ``dim`` at a time and replaced
by the nearest of 2**(b dim) vectors, a sign x pattern book whose patterns are a k-means (Lloyd)
codebook of the magnitudes of seeded N(0, I) samples -- a property of the Gaussian, never of
text -- scaled per group like the scalar codebook. One code of b dim bits per ``dim`` channels;
effective bits b + 16 / G. At equal bits a vector codebook covers the Gaussian's ball better
than a product of scalar grids (the "space-filling" and "shape" gains of vector quantization).

The Hadamard rotation (QuaRot, Ashkboos et al. 2024) spreads outliers across channels
before quantization: H is the normalized Walsh-Hadamard matrix, orthonormal and
symmetric, so H @ H = I and (x H)(y H)^T = x y^T. A head whose size is not a power of two
(80, 96) is rotated in power-of-two blocks, largest first (80 = 64 + 16): still orthonormal
and symmetric, with most channels mixed over the widest block.
"""

from __future__ import annotations

import functools
import math

import torch


class NonFiniteError(ValueError):
    """Raised when NaN or inf reaches a quantizer instead of silently poisoning a cache."""


def all_finite(x: torch.Tensor) -> bool:
    """Whether every element of x is finite: the smallest and largest are finite exactly when
    every element is (min and max propagate NaN). One pass, no temporary: faster than
    x.abs().amax(), and much faster than isfinite(x).all(), which makes an elementwise mask first."""
    return x.numel() == 0 or all(bool(torch.isfinite(m)) for m in torch.aminmax(x))


def check_finite(x: torch.Tensor) -> None:
    if not all_finite(x):
        raise NonFiniteError("cannot quantize NaN or inf values: the model produced non-finite keys/values")


def _grouped(x: torch.Tensor, group: int, axis: str) -> torch.Tensor:
    """View x (..., T, D) so that each quantization group is the reduction dim -1 or -2."""
    *lead, t, d = x.shape
    if axis == "token":
        return x.reshape(*lead, t, d // group, group)  # reduce over dim -1
    return x.reshape(*lead, t // group, group, d)  # reduce over dim -2


def _reduce_dim(axis: str) -> int:
    return -1 if axis == "token" else -2


def quantize_affine(
    x: torch.Tensor, bits: int, group: int, axis: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (..., T, D) -> codes (..., T, D) uint8, scale and zero float16.

    scale/zero are (..., T, D/G) for axis="token" and (..., T/G, D) for axis="channel".
    Codes are computed against the float16-rounded scale and zero so that what
    ``dequantize_affine`` sees is exactly what the codes were fitted to.
    """
    check_finite(x)
    dim = _reduce_dim(axis)
    xg = _grouped(x.float(), group, axis)
    lo = xg.amin(dim=dim, keepdim=True)
    hi = xg.amax(dim=dim, keepdim=True)
    qmax = 2**bits - 1
    scale = ((hi - lo) / qmax).to(torch.float16)
    zero = lo.to(torch.float16)
    s = scale.float()
    s = torch.where(s > 0, s, torch.ones_like(s))  # a constant group: every code is 0
    codes = ((xg - zero.float()) / s).round_().clamp_(0, qmax).to(torch.uint8)
    return codes.reshape(x.shape), scale.squeeze(dim), zero.squeeze(dim)


def dequantize_affine(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, axis: str
) -> torch.Tensor:
    """Inverse of quantize_affine: codes (..., T, D) -> float32 (..., T, D)."""
    dim = _reduce_dim(axis)
    cg = _grouped(codes, group, axis).float()
    x = cg * scale.float().unsqueeze(dim) + zero.float().unsqueeze(dim)
    return x.reshape(codes.shape)


def quantize_ternary(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., T, D) -> codes (..., T, D) in {0, 1, 2} (meaning -1, 0, +1), scale (..., T, D/G) fp16."""
    check_finite(x)
    xg = _grouped(x.float(), group, "token")  # (..., T, D/G, G)
    mag = xg.abs()
    keep = mag > 0.7 * mag.mean(dim=-1, keepdim=True)
    n_keep = keep.sum(dim=-1, keepdim=True).clamp_(min=1)
    scale = ((mag * keep).sum(dim=-1, keepdim=True) / n_keep).to(torch.float16)
    codes = (torch.sign(xg) * keep + 1).to(torch.uint8)
    return codes.reshape(x.shape), scale.squeeze(-1)


def dequantize_ternary(codes: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    cg = _grouped(codes, group, "token").float() - 1.0  # (..., T, D/G, G)
    return (cg * scale.float().unsqueeze(-1)).reshape(codes.shape)


@functools.lru_cache(maxsize=8)
def gaussian_codebook(bits: int) -> torch.Tensor:
    """Lloyd-Max levels for N(0, 1) with 2**bits levels, ascending, float32."""
    normal = torch.distributions.Normal(0.0, 1.0)
    n = 2**bits
    levels = torch.linspace(-2.5, 2.5, n, dtype=torch.float64)
    for _ in range(500):  # Lloyd's iteration: boundaries at midpoints, levels at conditional means
        edges = torch.cat([torch.tensor([-torch.inf]), (levels[1:] + levels[:-1]) / 2, torch.tensor([torch.inf])])
        pdf = torch.exp(normal.log_prob(edges.clamp(-40, 40))).double()
        mass = normal.cdf(edges[1:]) - normal.cdf(edges[:-1])
        levels = (pdf[:-1] - pdf[1:]) / mass
    return levels.float()


REFINE = 4  # rounds of scale refinement for the codebook codecs (native/encode.cpp takes the same)


def quantize_codebook(
    x: torch.Tensor, bits: int, group: int, refine: int = REFINE, log_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., T, D) -> codes (..., T, D) uint8 (index of the nearest level), scale (..., T, D/G):
    fp16, or with ``log_scale`` one byte u per group on the grid 2^((u - 128) / 16) (log_scales).

    The scale starts at the group's RMS (right for unit-Gaussian levels on average) and is
    then refined ``refine`` times by alternating minimization of the squared error: for
    fixed codes the best scale is <x, l> / <l, l> (l = the chosen levels), and for a fixed
    scale the best codes are the nearest levels. Neither step can raise the error, so the
    refined scale fits each group at least as well as its RMS (up to the stored form's rounding).
    """
    check_finite(x)
    xg = _grouped(x.float(), group, "token")  # (..., T, D/G, G)
    levels = gaussian_codebook(bits).to(x.device)
    mids = (levels[1:] + levels[:-1]) / 2
    stored = stored_log8 if log_scale else stored_fp16
    s = _refined_scale(xg, lambda s: levels[torch.bucketize(xg / s, mids)], refine, stored)  # (..., T, D/G, 1)
    codes = torch.bucketize(xg / s, mids).to(torch.uint8)  # nearest level for the stored scale
    s = s.squeeze(-1)  # (..., T, D/G)
    return codes.reshape(x.shape), log_scale_code(s) if log_scale else s.to(torch.float16)


def stored_fp16(s: torch.Tensor) -> torch.Tensor:
    """A scale as the cache stores it: float64 -> float32 -> fp16 (as the native encoder rounds),
    the smallest fp16, 2^-24, where that is not > 0: an all-zero group (or one below fp16's
    range) decodes to levels of 2^-24, not to levels of 1."""
    s = s.float().to(torch.float16).float()
    return torch.where(s > 0, s, torch.full_like(s, 2.0**-24))


# -- one-byte scales on a logarithmic grid: cheaper metadata --
#
# A byte u stands for s = 2^((u - 128) / 16): 16 steps an octave (4.4% apart), 2^-8 .. 2^7.94.
# Exactly T16[u % 16] * 2^(u // 16 - 8) with T16[j] = 2^(j / 16) rounded once to float32, so
# that a kernel decodes it with one 16-entry lookup and an exact power-of-two scaling
# (native/rows.h: scales16; the table in native/dtypes.h: LogScales), and the encoder rounds to
# the nearest grid point in log terms by comparing with the geometric midpoints
# sqrt(T[u] T[u + 1]), taken in float64 where the product of two floats is exact and the
# square root correctly rounded: the same on every machine and in native/encode.cpp. A group
# whose scale falls off the grid takes its end (a scale below 2^-8 -- values of a few
# thousandths -- is then too large for its codes).


@functools.lru_cache(maxsize=1)
def log_scales() -> torch.Tensor:
    """The 256 scales a one-byte scale decodes to, float32 (u = 128 is 1)."""
    t16 = torch.exp2(torch.arange(16, dtype=torch.float64) / 16).float()  # (16,) 2^(j/16)
    u = torch.arange(256)
    return t16[u % 16] * torch.exp2((u // 16 - 8).float())  # (256,) exact products


@functools.lru_cache(maxsize=1)
def _log_scale_bounds() -> torch.Tensor:
    t = log_scales().double()
    return (t[1:] * t[:-1]).sqrt()  # (255,) geometric midpoints, float64


def log_scale_code(s: torch.Tensor) -> torch.Tensor:
    """Scales (any shape, any float dtype) -> the nearest one-byte log scale's code, uint8 (0, the
    grid's smallest scale 2^-8, where s is not > 0)."""
    s = s.double()
    s = torch.where(s > 0, s, torch.zeros_like(s))  # below every midpoint: code 0
    return torch.bucketize(s, _log_scale_bounds().to(s.device)).to(torch.uint8)


def stored_log8(s: torch.Tensor) -> torch.Tensor:
    """A scale as a one-byte log scale stores it (the grid value), float64."""
    return log_scales().to(s.device)[log_scale_code(s).long()].double()


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """A stored scale part -> float32: fp16 scales as they are, one-byte codes through log_scales."""
    return log_scales().to(scale.device)[scale.long()] if scale.dtype == torch.uint8 else scale.float()


def _refined_scale(xg: torch.Tensor, chosen, refine: int, stored=stored_fp16) -> torch.Tensor:
    """The stored scale (..., 1) of each group of xg (..., G): its RMS, then ``refine`` rounds
    of alternating minimization -- chosen(s) (..., G) the codebook entries nearest xg / s, and the
    best scale for them <x, l> / <l, l>. Stored (``stored``: fp16, never 0) at every step, so the
    codes are chosen for the scale the cache will hold. The sums are taken in float64, where every product
    of an fp16-valued x and a float32 level is exact and a sum is off by at most its last bit, so
    that the order of the additions (torch's here, eight lanes in native/encode.cpp) moves a
    stored scale only at a rounding tie that close: the native encoder writes the same bytes."""
    x64 = xg.double()
    s = stored(x64.pow(2).mean(dim=-1, keepdim=True).sqrt())
    for _ in range(refine):
        c = chosen(s).double()
        s = stored((x64 * c).sum(-1, keepdim=True) / c.pow(2).sum(-1, keepdim=True).clamp_min(1e-12))
    return s


def dequantize_codebook(codes: torch.Tensor, scale: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    levels = gaussian_codebook(bits).to(codes.device)
    cg = levels[_grouped(codes, group, "token").long()]  # (..., T, D/G, G)
    return (cg * scale_values(scale).unsqueeze(-1)).reshape(codes.shape)


@functools.lru_cache(maxsize=4)
def gaussian_vector_codebook(dim: int, bits: int) -> torch.Tensor:
    """A sign-structured book of 2**(bits dim) vectors (n, dim), float32 values of float16s: P =
    n / 2**dim non-negative patterns fitted by Lloyd's k-means on the magnitudes |x| of 2**15
    N(0, I) samples drawn from a fixed seed, started from the first P samples, 30 rounds in
    float64 (~1 s, once per process), then rounded to float16 so that every machine gets the
    same table; vector k = pattern k % P with coordinate c negated where bit c of k // P is set.
    The nearest such vector of x takes x's signs and the pattern nearest to |x|: a book a kernel
    holds in registers."""
    n = 2 ** (bits * dim)
    g = torch.Generator().manual_seed(2604)
    x = torch.randn(2**15, dim, generator=g, dtype=torch.float64).abs()  # (S, dim)
    m = n >> dim  # patterns fitted
    c = x[:m].clone()  # (m, dim)
    for _ in range(30):
        nearest = _nearest(x, c)  # (S,)
        sums = torch.zeros_like(c).index_add_(0, nearest, x)
        counts = torch.bincount(nearest, minlength=m).unsqueeze(1)
        c = torch.where(counts > 0, sums / counts.clamp_min(1), c)
    k = torch.arange(n)
    negative = (k // m).unsqueeze(1) >> torch.arange(dim) & 1  # (n, dim)
    return (c[k % m] * (1 - 2 * negative)).to(torch.float16).float()


def vector_patterns(dim: int, bits: int) -> torch.Tensor:
    """The sign-structured book's non-negative patterns (P, dim), P = 2**(bits dim) / 2**dim: its
    first P vectors (``gaussian_vector_codebook``), as native/encode.cpp takes them."""
    book = gaussian_vector_codebook(dim, bits)  # (P 2**dim, dim)
    return book[: book.shape[0] >> dim]


def _nearest(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """For each row of x (S, dim) the index of the nearest row of c (n, dim), (S,) int64."""
    d = (c * c).sum(-1) - 2 * x @ c.T  # (S, n): squared distance less |x|^2, the same for every c
    return d.argmin(-1)


def _nearest_signed(x: torch.Tensor, patterns: torch.Tensor) -> torch.Tensor:
    """The nearest vector of the sign-structured book (``gaussian_vector_codebook``): for each
    row of x (S, dim) the index k = p + P s of vector p's pattern (patterns (P, dim), all >= 0)
    with coordinate c negated where bit c of s is set. The nearest such vector takes x's signs (a
    zero keeps +) and the pattern p that minimizes |p|^2 - 2 <|x|, p>, found in float64 with the
    sums taken coordinate by coordinate in order -- every product of two float32s exact there,
    every sum rounded alike -- so that native/encode.cpp picks the same code, ties to the lowest p."""
    a, p = x.abs().double(), patterns.to(x.device).double()  # (S, dim), (P, dim)
    dots, norms = a[:, :1] * p[:, 0], p[:, 0] * p[:, 0]  # (S, P), (P,)
    for c in range(1, x.shape[1]):
        dots = dots + a[:, c : c + 1] * p[:, c]
        norms = norms + p[:, c] * p[:, c]
    best = (norms - 2 * dots).argmin(-1)  # (S,): the first of equal distances
    signs = ((x < 0).long() << torch.arange(x.shape[1], device=x.device)).sum(-1)  # (S,): bit c if negative
    return best + patterns.shape[0] * signs


def quantize_vectors(
    x: torch.Tensor, dim: int, bits: int, group: int, refine: int = REFINE
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., T, D) -> codes (..., T, D/dim) int64 (index of the nearest codebook vector of each
    dim channels), scale (..., T, D/G) fp16. The scale is refined as ``quantize_codebook``
    refines it (alternating minimization of the squared error; neither step can raise it).
    Stored: bits x dim bits per code (one byte at 2 bits x 4) and 16 per G: bits + 16 / G per
    element."""
    check_finite(x)
    book = gaussian_vector_codebook(dim, bits).to(x.device)  # (n, dim)
    patterns = vector_patterns(dim, bits)  # (P, dim)
    xg = _grouped(x.float(), group, "token")  # (..., T, D/G, G)

    def nearest(s: torch.Tensor) -> torch.Tensor:  # (..., T, D/G, G/dim) codes for scale s
        v = (xg / s).reshape(-1, dim)
        return _nearest_signed(v, patterns).reshape(*xg.shape[:-1], group // dim)

    s = _refined_scale(xg, lambda s: book[nearest(s)].reshape(xg.shape), refine)  # (..., T, D/G, 1)
    codes = nearest(s)
    return codes.reshape(*x.shape[:-1], x.shape[-1] // dim), s.squeeze(-1).to(torch.float16)


def dequantize_vectors(codes: torch.Tensor, scale: torch.Tensor, dim: int, bits: int, group: int) -> torch.Tensor:
    """codes (..., T, D/dim), scale (..., T, D/G) fp16 -> float32 (..., T, D)."""
    book = gaussian_vector_codebook(dim, bits).to(codes.device)
    v = book[codes.long()].reshape(*codes.shape[:-1], codes.shape[-1] * dim)  # (..., T, D)
    return (_grouped(v, group, "token") * scale.float().unsqueeze(-1)).reshape(v.shape)


def hadamard_blocks(d: int) -> list[int]:
    """The power-of-two blocks, largest first, that a head of d channels is rotated in: one block
    when d is a power of two (64, 128), else its binary digits (80 = 64 + 16, 96 = 64 + 32)."""
    return [1 << b for b in reversed(range(d.bit_length())) if d >> b & 1]


@functools.lru_cache(maxsize=16)
def _hadamard_cpu(d: int) -> torch.Tensor:
    h = torch.zeros(d, d)
    i = 0
    for n in hadamard_blocks(d):
        block = torch.ones(1, 1)
        while block.shape[0] < n:  # Sylvester's construction: [[H, H], [H, -H]]
            block = torch.cat([torch.cat([block, block], 1), torch.cat([block, -block], 1)], 0)
        h[i : i + n, i : i + n] = block / math.sqrt(n)
        i += n
    return h


def hadamard_matrix(d: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The rotation (d, d): the normalized Walsh-Hadamard matrix for a power-of-two d, else the
    block-diagonal matrix of one per hadamard_blocks(d). Orthonormal and symmetric either way."""
    if d < 1:
        raise ValueError(f"a Hadamard rotation needs at least one channel, got {d}")
    return _hadamard_cpu(d).to(device=device, dtype=dtype)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) -> x @ H in x's dtype (H = hadamard_matrix(D)). Since H is symmetric and
    orthonormal this is also the inverse.

    Computed block by block as the fast Walsh-Hadamard transform (log2 n rounds of sums and
    differences of halves of blocks, in float32, then one scale by 1/sqrt(n) and one rounding to
    x's dtype): n log n work instead of n^2, and the very operations, in the very order, of the
    C++ cache write (native/hadamard.h), so both store identical bytes."""
    y, out, i = x.float(), [], 0
    for n in hadamard_blocks(x.shape[-1]):
        b, h = y[..., i : i + n], 1
        while h < n:
            pairs = b.reshape(*b.shape[:-1], n // (2 * h), 2, h)  # (..., blocks, 2, h): pairs h apart
            b = torch.stack([pairs[..., 0, :] + pairs[..., 1, :], pairs[..., 0, :] - pairs[..., 1, :]], -2)
            b = b.reshape(*y.shape[:-1], n)
            h *= 2
        out.append(b * (1.0 / math.sqrt(n)))
        i += n
    return torch.cat(out, -1).to(x.dtype)


def frequency_block_order(d: int, nb: int) -> list[int]:
    """A head's d channels block by block: block i holds RoPE frequencies i F .. (i + 1) F - 1
    (F = d / 2 / nb; frequency 0 the fastest), each with both channels of its rotate-half pair
    (f, f + d / 2), so a block is closed under RoPE."""
    f, half = d // 2 // nb, d // 2
    return [c for i in range(nb) for h in (0, half) for c in range(h + i * f, h + (i + 1) * f)]


def block_rotate(x: torch.Tensor, nb: int) -> torch.Tensor:
    """x (..., D) -> its nb frequency blocks in order (frequency_block_order), each x_b H_n
    (n = D / nb, hadamard_rotate): an orthonormal map; block_unrotate inverts it."""
    d = x.shape[-1]
    y = x[..., frequency_block_order(d, nb)]  # (..., D) block by block
    return hadamard_rotate(y.reshape(*x.shape[:-1], nb, d // nb)).reshape(x.shape)


def block_unrotate(y: torch.Tensor, nb: int) -> torch.Tensor:
    """Inverse of block_rotate: each block rotated back (H_n is its own inverse), channels put back."""
    d = y.shape[-1]
    z = hadamard_rotate(y.reshape(*y.shape[:-1], nb, d // nb)).reshape(y.shape)  # (..., D) block by block
    out = torch.empty_like(z)
    out[..., frequency_block_order(d, nb)] = z
    return out
