"""The integer-domain attention kernels (int8 query x packed codes) against exact float math.

The integer path is an approximation with a known bound, derived from the int8 rounding:

* scores: the query is q ~= a * q8 with a = max|q| / 127 over each block of 8 channels (at
  most the head's max|q| / 127, which the bound below uses), so each channel's query is off by
  at most a/2 and a score q.k_t = sum_d q_d (s_t c_td + z_t) by at most
  a/2 * s_t * sum_d c_td (the zero points are applied exactly); for KIVI keys the
  per-channel scales are folded in first, qs_d = q_d s_gd ~= a_g q8_d per group of tokens,
  and the bound is a_g/2 * sum_d c_td;
* values: w_t = p_t s_t is rounded to unsigned bytes per block of 32 tokens, w ~= b * w8 with
  b = max w / 255, with error diffusion (each remainder d_t, |d_t| <= 1/2, is carried into the
  next token), so the error of an output channel over one block is
  b * (sum_t d_t (c_t+1,d - c_td) - d_last c_last,d), at most b/2 * (sum_t |c_t+1,d - c_td| + c_last,d).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from minillama.eval.synthetic import fill_synthetic
from minillama.kv import packing
from minillama.kv.cache import KVCache
from minillama.kv.codecs import ChannelAffine
from minillama.kv.quantize import gaussian_codebook, gaussian_vector_codebook
from minillama.kv.spec import parse_kv
from minillama.native import abi, backend
from minillama.native.abi import NotSupported, Route
from minillama.native.build import build
from minillama.native.plans import attend_one_part, fused_decode_attention, held_parts, route, row_source


@pytest.fixture(params=["native", "avx2"])
def lib(request):
    """Each build with the integer kernels (they need AVX2 and BMI2), on the kernels backend."""
    with backend.using("kernels", request.param):
        library = backend.library()
        if library is None or not {"avx2", "bmi2"} <= set(abi.features(library)):
            pytest.skip(f"no {request.param} build with AVX2 and BMI2 here: {build(request.param)[1] or 'no BMI2'}")
        yield library


def body_part(cache: KVCache, values: bool):
    """The body part of layer 0's keys (or values), as the kernels see it."""
    k_parts, v_parts = held_parts(cache.layer(0))
    return next(p for p in (v_parts if values else k_parts) if p.name == "body")


def integer_call(lib, cache: KVCache, values: bool, x: torch.Tensor, out: torch.Tensor) -> None:
    """The body of layer 0's keys (scores of q = x) or values (p = x weights them) through the
    integer kernel alone (asked for by name: on a CPU without VNNI attend_layer routes these rows
    to the faster exact kernels, kv/fused_attention.py: route)."""
    attend_one_part(lib, values, body_part(cache, values), x, out, via=Route.INTEGER)


@contextlib.contextmanager
def skipped_where_unread(lib, what: str):
    """Codes only the AVX-512 VNNI build's integer route reads: on a build without VNNI the kernel
    refuses them with its reason and the test is skipped with it; a VNNI build that refuses them
    fails."""
    try:
        yield
    except NotSupported as e:
        if "avx512_vnni" in abi.features(lib):
            raise
        pytest.skip(f"this target's integer route does not read {what} ({e})")


SCORE_SPECS = [
    "kivi4",
    "hadv2",
    "k=int4h,v=int3h,group=64,residual=32,sinks=4,center=1",
    "kivi2",
    "k=int2c,v=int4,group=16,residual=3",
    "k=int3h,v=int4,group=64,residual=3",
    "k=int4,v=int2,group=64,residual=5,sinks=4",
    "k=int2h,v=int3h,group=64,residual=0",
]
VALUE_SPECS = [
    "kivi4",
    "hadv2",
    "k=int4h,v=int3h,group=64,residual=32,sinks=4,center=1",
    "kivi2",
    "k=int4c,v=int3h,group=32,residual=3",
    "k=int4c,v=int4h,vgroup=64,residual=5,sinks=4",
]


def filled(spec: str, n: int, batch: int, capacity: int = 1200, head_dim: int = 64):
    cache = KVCache(parse_kv(spec), n_layers=1, n_kv_heads=2, head_dim=head_dim, capacity=capacity, batch=batch)
    fill_synthetic(cache, n, chunk=13)
    return cache


def body(store):
    """The body's codes (B, H, n, D) as integers and its parts, in age order."""
    parts = {name: ring.read() for name, ring in store.body.items()}
    return packing.unpack(parts["codes"], store.codec.packing, store.head_dim).float(), parts


def check_score_bound(lib, spec: str, n: int, batch: int, r: int = 3, d: int = 64) -> None:
    cache = filled(spec, n, batch, head_dim=d)
    store = cache.layers[0][0]
    codes, parts = body(store)  # (B, H, m, D)
    m, g = store.n_body, store.group
    q = torch.randn(batch, 2, r, d)  # (B, H, R, D), in the key codec's space
    got = torch.empty(batch, 2, r, m)
    integer_call(lib, cache, False, q, got)
    exact = q @ store.codec.decode(parts, g, d).transpose(-1, -2)  # (B, H, R, m)
    if isinstance(store.codec, ChannelAffine):
        scale = parts["scale"].float().repeat_interleave(g, dim=2)[:, :, :m]  # (B, H, m, D): each token's scales
        qs = q.unsqueeze(3) * scale.unsqueeze(2)  # (B, H, R, m, D): the folded query per token
        a = qs.abs().amax(-1) / 127  # (B, H, R, m): the folded query's int8 step
        bound = a / 2 * codes.sum(-1).unsqueeze(2)  # the scales are inside a already
    else:
        a = q.abs().amax(-1, keepdim=True) / 127  # (B, H, R, 1)
        bound = a / 2 * (parts["scale"].float().transpose(-1, -2) * codes.abs().sum(-1).unsqueeze(2))
    assert ((got - exact).abs() <= bound * (1 + 1e-4) + 1e-4).all()
    assert (got - exact).abs().max() > 0  # it is the integer path, not the exact one


@pytest.mark.parametrize("spec", SCORE_SPECS)
@pytest.mark.parametrize("n, batch", [(77, 1), (333, 3), (1000, 1)])
def test_integer_scores_are_within_the_int8_query_bound(lib, spec, n, batch):
    check_score_bound(lib, spec, n, batch)


@pytest.mark.parametrize("codes", ["int4c", "int3h", "int4"])
@pytest.mark.parametrize("r, d", [(1, 64), (2, 128), (5, 64), (8, 128), (16, 64), (16, 128)])
def test_integer_scores_hold_the_bound_for_every_gqa_and_head_size(lib, codes, r, d):
    """The SIMD score kernels keep up to 16 heads' queries: every grouping of heads, one or two
    64-channel chunks a row, 4-bit nibbles and 3-bit rows unpacked by shuffles, per-channel
    (KIVI, groups of 16 tokens) and per-token codes (one scale a row)."""
    group = "kgroup=16" if codes.endswith("c") else f"kgroup={d}"
    check_score_bound(lib, f"k={codes},v=int4,{group},residual=3", 301, 1, r, d)


def int8_levels(book: torch.Tensor, ks: range = range(127, 95, -1)) -> tuple[float, torch.Tensor, float]:
    """A kernel's small-integer copy of a book (rows.h: levels8): L8 = round(L / t), t = max |L| / K
    for the K in `ks` (the score kernels: 127..96) with the smallest worst relative error; that
    error, each level's copy's absolute error, and t."""
    big = book.abs().max().item()
    best = None
    for k in ks:  # the first K on a tie, as the kernel
        t = big / k
        err = ((book / t).round() * t - book).abs()  # (levels,)
        worst = (err / book.abs()).max().item()
        if best is None or worst < best[0]:
            best = (worst, err, t)
    return best


def byte_value_levels(book: torch.Tensor) -> torch.Tensor:
    """The AVX2 byte copy of a book (avx2_int_values.cpp's values, avx2_attention.cpp's 2-bit keys:
    K in 16..4), as floats."""
    _, _, t = int8_levels(book, range(16, 3, -1))
    return (book / t).round() * t


def key_level_error(book: torch.Tensor) -> torch.Tensor:
    """How far the score kernel's copy of each level is from it: int8 (int8_levels) where every
    level stays within 0.5%, else 16-bit, off by at most max |L| / 4094."""
    worst, err, _ = int8_levels(book)
    return err if worst <= 0.005 else torch.full_like(book, book.abs().max().item() / 4094)


def byte_key_levels(lib, bits: int) -> bool:
    """Whether this build scores `bits`-bit codebook keys with byte levels (AVX2: score_int2, 2-bit
    books only): levels K in 16..4, the query's int8 step per block of 16 channels."""
    return bits == 2 and "avx512" not in abi.features(lib)


@pytest.mark.parametrize("r, d", [(1, 64), (3, 64), (3, 128), (8, 128), (16, 64), (16, 128)])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codebook_keys_hold_their_level_bound_where_a_target_reads_them(lib, r, d, bits):
    """Lloyd-Max 2-, 3- and 4-bit keys (one scale a row) on the integer route: the query becomes int8
    per chunk of 8 channels (a_c = max |q| / 127 over the chunk; 16 channels for AVX2's 2-bit keys)
    and the levels int8 where that keeps every level within 0.5% (2- and 3-bit books; K in 16..4 on
    AVX2), else 16-bit (key_level_error), so a score is off by at most
    s_t sum_d (a_c / 2 (|L| + e_L) + |q_d| e_L). With VNNI 2- and 3-bit rows are widened to the 4-bit
    layout first (where vpermb exists); AVX2 splits 2-bit rows by shifts (score_int2). For 1 to 16
    query heads per KV head and head_dim 64 and 128 (one or two 64-channel chunks a row)."""
    spec = f"k=lm{bits}h,v=int4,kgroup={d},residual=0"
    byte = byte_key_levels(lib, bits)
    chunk = 16 if byte else 8
    cache = filled(spec, 301, 1, head_dim=d)
    store = cache.layers[0][0]
    codes, parts = body(store)  # (B, H, m, D)
    m = store.n_body
    q = torch.randn(1, 2, r, d)  # (B, H, R, D), in the key codec's space
    got = torch.empty(1, 2, r, m)
    with skipped_where_unread(lib, f"{bits}-bit codebook keys"):
        integer_call(lib, cache, False, q, got)
    exact = q @ store.codec.decode(parts, store.group, d).transpose(-1, -2)  # (B, H, R, m)
    book = gaussian_codebook(bits)
    levels = book[codes.long()].abs()  # (B, H, m, D)
    copy_error = (byte_value_levels(book) - book).abs() if byte else key_level_error(book)  # (levels,)
    level_error = copy_error[codes.long()]  # (B, H, m, D)
    a = q.abs().reshape(1, 2, r, d // chunk, chunk).amax(-1).repeat_interleave(chunk, -1) / 127  # (B, H, R, D)
    query_error = (a / 2).unsqueeze(3) * (levels + level_error).unsqueeze(2)  # (B, H, R, m, D)
    per_token = query_error + q.abs().unsqueeze(3) * level_error.unsqueeze(2)  # (B, H, R, m, D): plus the levels' error
    bound = parts["scale"].float().transpose(-1, -2) * per_token.sum(-1)  # (B, H, R, m)
    assert ((got - exact).abs() <= bound * (1 + 1e-4) + 1e-5).all()
    assert (got - exact).abs().max() > 0  # it is the integer path, not the exact one
    # A query the int8 rounding keeps exactly (integers, each chunk's max 127): only the levels' error is left.
    q = torch.randint(-127, 128, (1, 2, r, d)).float()
    q[..., ::chunk] = 127
    integer_call(lib, cache, False, q, got)
    exact = q @ store.codec.decode(parts, store.group, d).transpose(-1, -2)
    bound = parts["scale"].float().transpose(-1, -2) * (q.abs().unsqueeze(3) * level_error.unsqueeze(2)).sum(
        -1
    )  # (B, H, R, m)
    assert ((got - exact).abs() <= bound * (1 + 1e-3) + 1e-3).all()
    assert ((got - exact).abs() > bound / 100).any()  # the levels are not exact


@pytest.mark.parametrize("r", [1, 3, 8, 16])
@pytest.mark.parametrize(
    "codec",
    [
        "lm2f2:13.22",  # two blocks, widths 1-3: every book's levels as bytes
        "lm2f2:04.22",  # a dropped block beside a 4-bit one: that head's levels 16-bit
        "lm3f4:2244.1344",  # four blocks of 16 channels
        "lm2f8:22222222.13131313",  # eight blocks of 8 channels: one query step each
    ],
)
def test_block_keys_hold_their_level_bound_where_a_target_reads_them(lib, r, codec):
    """Keys in RoPE frequency blocks (kv/freq_blocks.py) on the integer route at head_dim 64
    (avx512_vnni_attention.cpp: score_vnni_blocks): score_vnni's bound block by block. The query becomes
    int8 per chunk of 8 channels (a_c = max |q| / 127 over the chunk); each block's levels come
    from the book of its width -- int8 where every block of the head keeps its levels within
    0.5% (widths 1-3), else 16-bit (key_level_error) -- times the token's scale of the block, so a
    score is off by at most sum_b s_tb sum_(d in b) (a_c / 2 (|L_d| + e_d) + |q_d| e_d)."""
    from minillama.kv.freq_blocks import block_widths
    from minillama.kv.quantize import scale_values

    d = 64
    cache = filled(f"k={codec},v=int4,residual=0", 301, 1, head_dim=d)
    store = cache.layers[0][0]
    parts = {name: ring.read() for name, ring in store.body.items()}
    codes = store.codec.unpack(parts, d).long()  # (B, H, m, D): each block's codes in its channels
    m, nb = store.n_body, store.codec.blocks
    widths = block_widths(store.codec.widths)  # (H, nb)
    q = torch.randn(1, 2, r, d)  # (B, H, R, D), in the key codec's space (blocks in order)
    got = torch.empty(1, 2, r, m)
    with skipped_where_unread(lib, "frequency-block keys"):
        integer_call(lib, cache, False, q, got)
    exact = q @ store.codec.decode(parts, store.group, d).transpose(-1, -2)  # (B, H, R, m)
    level = torch.zeros(1, 2, m, d)  # |L_d| of each token's channels
    error = torch.zeros(1, 2, m, d)  # e_d: how far the kernel's copy of that level is
    for h in range(2):
        books = [gaussian_codebook(int(w)) if w else torch.zeros(1) for w in widths[h]]
        byte = all(int8_levels(book)[0] <= 0.005 for book, w in zip(books, widths[h]) if w)
        for b, (book, w) in enumerate(zip(books, widths[h])):
            channels = slice(b * d // nb, (b + 1) * d // nb)
            if not w:
                continue
            copy = int8_levels(book)[1] if byte else torch.full_like(book, book.abs().max().item() / 4094)
            level[0, h, :, channels] = book[codes[0, h, :, channels]].abs()
            error[0, h, :, channels] = copy[codes[0, h, :, channels]]
    scale = scale_values(parts["scale"]).repeat_interleave(d // nb, dim=-1)  # (B, H, m, D): each channel's block scale
    a = q.abs().reshape(1, 2, r, d // 8, 8).amax(-1).repeat_interleave(8, -1) / 127  # (B, H, R, D)
    per_channel = (a / 2).unsqueeze(3) * (level + error).unsqueeze(2) + q.abs().unsqueeze(3) * error.unsqueeze(2)
    bound = (scale.unsqueeze(2) * per_channel).sum(-1)  # (B, H, R, m)
    assert ((got - exact).abs() <= bound * (1 + 1e-4) + 1e-5).all()
    assert (got - exact).abs().max() > 0  # it is the integer path, not the exact one


def test_block_keys_take_the_integer_route_only_where_a_kernel_reads_them_whole():
    """The VNNI block-key kernel reads head_dim 64 with every width at most 4; a head with a wider
    block is read by the exact block kernel inside the same route (layer_attention.cpp:
    score_block), and head_dim 128 block keys keep the rows route."""
    lib = backend.library()
    if lib is None or "avx512_vnni" not in abi.features(lib) or "avx512_vbmi" not in abi.features(lib):
        pytest.skip("the integer block-key kernel needs AVX-512 VNNI and VBMI")
    for d, codec, expected in ((64, "lm3f2:24.15", Route.INTEGER), (128, "lm3f2:24.15", Route.ROWS)):
        cache = filled(f"k={codec},v=int4,residual=0", 40, 1, head_dim=d)
        part = body_part(cache, False)
        assert route(lib, False, part, row_source(part, None, None, []), 3, d) == expected, (d, codec)


def test_byte_key_levels_are_chosen_only_where_they_hold_half_a_percent():
    """The 2- and 3-bit Gaussian books fit int8 within 0.5% of every level; the 4-bit one does not
    (its smallest level, 5 steps of 107, is 1.3% off) and keeps the 16-bit levels."""
    for bits, byte in ((2, True), (3, True), (4, False)):
        worst, _, _ = int8_levels(gaussian_codebook(bits))
        assert (worst <= 0.005) == byte, (bits, worst)


def check_value_bound(lib, spec: str, n: int, batch: int, r: int = 3, d: int = 64) -> None:
    cache = filled(spec, n, batch, head_dim=d)
    store = cache.layers[0][1]
    codes, parts = body(store)
    m, g = store.n_body, store.group
    p = torch.softmax(torch.randn(batch, 2, r, m) * 3, -1)  # peaked attention weights
    got = torch.zeros(batch, 2, r, d)
    integer_call(lib, cache, True, p, got)
    exact = p @ store.codec.decode(parts, g, d)
    scale = parts["scale"].float().repeat_interleave(g, dim=-1)  # (B, H, m, D): each channel's scale
    w = p.unsqueeze(-1) * scale.unsqueeze(2)  # (B, H, R, m, D)
    blocks = torch.arange(m) // 32  # the kernel's blocks of 32 tokens
    bound = torch.zeros_like(exact)  # (B, H, R, D)
    for k in range(int(blocks.max()) + 1):
        sel = blocks == k
        b = w[..., sel, :].amax(dim=3) / 255  # (B, H, R, D)
        c = codes[..., sel, :].float()  # (B, H, len, D)
        steps = (c[..., 1:, :] - c[..., :-1, :]).abs().sum(2) + c[..., -1, :]  # (B, H, D)
        bound += b / 2 * steps.unsqueeze(2)
    assert ((got - exact).abs() <= bound * (1 + 1e-4) + 1e-5).all()


@pytest.mark.parametrize("spec", VALUE_SPECS)
@pytest.mark.parametrize("n, batch", [(77, 1), (333, 3), (1000, 1)])
def test_integer_values_are_within_the_byte_weight_bound(lib, spec, n, batch):
    check_value_bound(lib, spec, n, batch)


@pytest.mark.parametrize(
    "spec",
    [
        "k=int4c,v=int8,group=32,residual=0",  # bytes: one field per byte
        "k=int4c,v=int2,vgroup=16,residual=0",  # several channel groups in one register
    ],
)
@pytest.mark.parametrize("d", [64, 128])
def test_integer_values_hold_the_bound_where_a_target_reads_them(lib, spec, d):
    """Codes only AVX-512 VNNI's integer values read; the other targets' integer routes refuse
    them with the reason (the exact kernels read them there)."""
    with skipped_where_unread(lib, spec):
        check_value_bound(lib, spec, 301, 1, 3, d)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("r, vgroup", [(3, 32), (1, 64), (8, 64), (16, 32)])
def test_codebook_values_hold_their_level_bound_where_a_target_reads_them(lib, bits, d, r, vgroup):
    """Lloyd-Max values on the integer route, for groups of 32 channels (two in a register's
    halves) and 64, and every grouping of query heads. With VNNI levels become int16, L16 =
    round(L 2047 / max |L|), so a level is off by at most max |L| / 4094 (int8 levels moved the
    small ones by 3%), and the weights p s become int16 per block of 32 tokens (off by at most
    max w / 65534). On AVX2 only books whose levels hold within 0.5% as integers up to 16 (the
    2-bit one: 3 and 10) are read, with byte weights and error diffusion as affine codes. The
    error of each output is bounded by the sum of the level and the weight errors."""
    spec = f"k=int4c,v=lm{bits}h,kgroup=32,vgroup={vgroup},residual=0"
    cache = filled(spec, 301, 1, head_dim=d)
    store = cache.layers[0][1]
    codes, parts = body(store)  # (B, H, m, D)
    m, g = store.n_body, store.group
    p = torch.softmax(torch.randn(1, 2, r, m) * 3, -1)  # (B, H, R, m): peaked attention weights
    got = torch.zeros(1, 2, r, d)
    with skipped_where_unread(lib, "codebook values"):
        integer_call(lib, cache, True, p, got)
    exact = p @ store.codec.decode(parts, g, d)  # (B, H, R, D)
    book = gaussian_codebook(bits)
    if "avx512_vnni" in abi.features(lib):
        assert_int16_level_bound(got, exact, p, book[codes.long()], parts["scale"], g, book.abs().max())
    else:
        assert_byte_level_bound(got, exact, p, book[codes.long()], byte_value_levels(book)[codes.long()], parts, g)


def assert_byte_level_bound(got, exact, p, levels, copies, parts, g: int) -> None:
    """The AVX2 integer values of a codebook: each level L read as its copy L8 t (copies, like
    levels (B, H, m, D)), each weight w = p s as bytes per block of 32 tokens with error
    diffusion, so over a block the output is off by at most b/2 (sum_t |L'_t+1 - L'_t| + |L'_last|)
    (b = max w / 255, L' the copies; the module docstring's bound for codes) plus sum_t w_t |L'_t - L_t|."""
    m = levels.shape[2]
    scale = parts["scale"].float().repeat_interleave(g, dim=-1)  # (B, H, m, D)
    w = p.unsqueeze(-1) * scale.unsqueeze(2)  # (B, H, R, m, D)
    bound = (w * (copies - levels).abs().unsqueeze(2)).sum(3)  # (B, H, R, D): the levels' copies
    blocks = torch.arange(m) // 32
    for k in range(int(blocks.max()) + 1):
        sel = blocks == k
        b = w[..., sel, :].amax(dim=3) / 255  # (B, H, R, D)
        c = copies[..., sel, :]  # (B, H, len, D)
        steps = (c[..., 1:, :] - c[..., :-1, :]).abs().sum(2) + c[..., -1, :].abs()  # (B, H, D)
        bound += b / 2 * steps.unsqueeze(2)
    assert ((got - exact).abs() <= bound * (1 + 1e-4) + 1e-5).all()
    assert (got - exact).abs().max() > 0  # it is the integer path, not the exact one


def assert_int16_level_bound(got, exact, p, levels, scale, g: int, big: float) -> None:
    """The integer route's values with int16 levels and int16 weights: a level (levels (B, H, m,
    D), each channel's) is off by at most big / 4094 (big = max |L| of the book), each weight
    p s by half its block's step (max w / 32767, blocks of 32 tokens); the output error is at
    most the sum of both. And it is an approximation: the exact kernels were not taken."""
    m = levels.shape[2]
    scale = scale.float().repeat_interleave(g, dim=-1)  # (B, H, m, D)
    w = p.unsqueeze(-1) * scale.unsqueeze(2)  # (B, H, R, m, D): each level's weight
    level_error = w.sum(3) * big / 4094  # (B, H, R, D)
    blocks = torch.arange(m) // 32
    weight_error = torch.zeros_like(exact)
    for k in range(int(blocks.max()) + 1):
        sel = blocks == k
        b = w[..., sel, :].amax(dim=3) / 32767  # (B, H, R, D): the block's int16 weight step
        weight_error += b / 2 * (levels[..., sel, :].abs().sum(2) * 1.001).unsqueeze(2)
    assert ((got - exact).abs() <= (level_error + weight_error) * (1 + 1e-4) + 1e-6).all()
    assert (got - exact).abs().max() > 0  # it is the integer path, not the exact one


@pytest.mark.parametrize("codec", ["vq2hs"])
@pytest.mark.parametrize("vgroup", [16, 64])
@pytest.mark.parametrize("r, d", [(1, 64), (3, 64), (8, 128), (16, 128)])
def test_vector_coded_values_hold_the_int16_level_bound_where_a_target_reads_them(lib, codec, vgroup, r, d):
    """vq2hs values on the integer route: the book's numbers become int16 (off by at most
    max |L| / 4094, as a codebook's levels), each token's channels come from the 16 sign-free
    patterns in registers, and the weights are
    int16 per block of 32 tokens; the output error is bounded by the sum of both, for one and
    several channel groups, every grouping of heads, an odd count."""
    spec = f"k=int4c,v={codec},kgroup=32,vgroup={vgroup},residual=0"
    cache = filled(spec, 301, 1, head_dim=d)
    store = cache.layers[0][1]
    parts = {name: ring.read() for name, ring in store.body.items()}
    codes, m, g = parts["codes"].long(), store.n_body, store.group  # codes (B, H, m, D/4)
    p = torch.softmax(torch.randn(1, 2, r, m) * 3, -1)  # (B, H, R, m): peaked attention weights
    got = torch.zeros(1, 2, r, d)
    with skipped_where_unread(lib, "vector codes"):
        integer_call(lib, cache, True, p, got)
    exact = p @ store.codec.decode(parts, g, d)  # (B, H, R, D)
    book = gaussian_vector_codebook(4, 2)  # (256, 4)
    levels = book[codes].reshape(1, 2, m, d)  # (B, H, m, D): each channel's level
    assert_int16_level_bound(got, exact, p, levels, parts["scale"], g, book.abs().max())


@pytest.mark.parametrize(
    "spec",
    [
        "k=int4c,v=int2,group=32,residual=0",
        "k=int4c,v=int4,vgroup=64,residual=0",
        "kivi4",
        "k=int4c,v=int3h,group=32,residual=0",  # 3-bit rows: unpacked to bytes first on AVX2
        "k=int4c,v=int3h,vgroup=64,residual=0",
    ],
)
@pytest.mark.parametrize("r, d", [(1, 64), (2, 128), (5, 64), (8, 128), (16, 64), (16, 128)])
def test_integer_values_hold_the_bound_for_every_gqa_and_head_size(lib, spec, r, d):
    """The SIMD value kernels keep several heads' sums in registers and step up to 64 weight
    chains (head x channel group) eight at a time: every grouping of heads, one or two 64-channel
    chunks, 3-bit rows unpacked by shuffles, and an odd number of tokens (a last token without a
    partner)."""
    check_value_bound(lib, spec, 301, 1, r, d)


def test_integer_values_keep_the_mass_of_a_long_tail(lib):
    """In every block of 32 tokens one weight A and 31 weights A/600, each below half a byte
    step (b/2 = A/510), over identical value rows. Plain rounding would send all the small
    weights to zero, an error of 31 A/600 per block, 26x the bound b/2 * c that error diffusion
    keeps (the codes do not change from token to token, so only the last code counts)."""
    cache = KVCache(
        parse_kv("k=int4c,v=int4,group=64,residual=0"), n_layers=1, n_kv_heads=1, head_dim=64, capacity=512, batch=1
    )
    keys = torch.randn(1, 1, 512, 64)  # (B, H, T, D)
    values = torch.linspace(-1, 1, 64).expand(1, 1, 512, 64).contiguous()  # (B, H, T, D): one row
    cache.append([(keys, values)])
    store = cache.layers[0][1]
    codes, parts = body(store)
    m = store.n_body
    p = torch.full((1, 1, 3, m), 1 / 600)  # (B, H, R, m)
    p[..., ::32] = 1.0
    p = p / p.sum(-1, keepdim=True)
    got = torch.zeros(1, 1, 3, 64)
    integer_call(lib, cache, True, p, got)
    exact = p @ store.codec.decode(parts, 64, 64)
    w_max = p[..., ::32].unsqueeze(-1) * parts["scale"].float()[..., ::32, :].unsqueeze(2)  # (B, H, R, blocks, 1)
    row = codes[..., 0:1, :].unsqueeze(2)  # (B, H, 1, 1, D): every token's codes
    bound = (w_max / 255 / 2 * row).sum(3)  # (B, H, R, D)
    lost = (31 / 600 * w_max * row).sum(3)  # what plain rounding would drop
    assert (lost > 20 * bound).any()
    assert ((got - exact).abs() <= bound * (1 + 1e-4) + 1e-5).all()


@pytest.mark.parametrize(
    "spec, row",
    [
        ("k=int4c,v=int4,group=32,residual=0", "ones"),  # codes 15 in 31 channels of each 32
        ("k=int4c,v=lm2h,vgroup=64,residual=0", "spike"),  # rotated: every channel the same outer level
    ],
)
def test_integer_values_widen_in_time_when_a_block_has_flat_weights(lib, spec, row):
    """The byte kernels add pairs of byte products in 16 bits and widen to 32 before a sum can
    overflow: after a block (32 tokens) when its weights are peaked enough that no sum can reach
    2^15, else every few pairs (4 for 4-bit codes, 6 for the 2-bit book's levels of 10). Equal
    weights over identical rows of the largest codes are the worst case (each 16-bit sum 32 x 255
    x the code): an overflow would put the result off by far more than the rounding bound."""
    if row == "ones":
        values = torch.ones(64)
        values[::32] = -1.0  # one low channel a group, so the rest take the top code
    else:
        values = torch.zeros(64)
        values[0] = 8.0  # the Hadamard rotation spreads it evenly over every channel
    cache = KVCache(parse_kv(spec), n_layers=1, n_kv_heads=1, head_dim=64, capacity=256, batch=1)
    cache.append([(torch.randn(1, 1, 96, 64), values.expand(1, 1, 96, 64).contiguous())])  # (B, H, T, D) each
    store = cache.layers[0][1]
    codes, parts = body(store)
    m = store.n_body
    assert (codes == codes[..., :1, :]).all() and codes.float().mean() > 0  # identical rows, far from code 0
    p = torch.full((1, 1, 3, m), 1 / m)  # (B, H, R, m): flat weights, every byte weight 255
    got = torch.zeros(1, 1, 3, 64)
    integer_call(lib, cache, True, p, got)
    exact = p @ store.codec.decode(parts, store.group, 64)  # (B, H, R, D)
    assert torch.allclose(got, exact, atol=1e-3 * exact.abs().max().item())


@pytest.mark.parametrize(
    "spec",
    [
        "kivi4",
        "hadv2",
        "k=int4h,v=int3h,group=64,residual=32,sinks=4,center=1",
        "k=lm3h,v=lm2h,group=64,residual=8,sinks=4",
        "k=int4c,v=int2h,group=8,residual=8,sinks=4",
        "k=lm3h,v=vq2hs,group=64,residual=8",
    ],
)
@pytest.mark.parametrize("n, capacity", [(45, 1200), (700, 200)])  # 700 into 200: the ring wraps
def test_whole_attention_on_the_integer_path_stays_within_its_bound(lib, spec, n, capacity):
    """Sinks and residual stay exact; the body's score error e moves every softmax weight by at
    most a factor exp(+-2e/sqrt(D)), so the output moves by at most (exp(2e/sqrt(D)) - 1) max|v|
    plus the values' own bound (here taken loosely as 1% of max|v|)."""
    cache = filled(spec, n, 2, capacity)
    assert (cache.evicted > 0) == (n > capacity)
    g = torch.Generator().manual_seed(n)
    q, k, v = (
        torch.randn(2, 6, 1, 64, generator=g),
        torch.randn(2, 2, 1, 64, generator=g),
        torch.randn(2, 2, 1, 64, generator=g),
    )
    fast = fused_decode_attention(lib, q, k, v, cache.layer(0))
    with backend.using("kernels-exact"):
        exact = fused_decode_attention(lib, q, k, v, cache.layer(0))
    vmax = cache.layer(0).read(torch.float32)[1].abs().max()
    score_err = 0.1  # generous: the bounds above for these unit-scale synthetic keys are ~1e-2
    assert (fast - exact).abs().max() <= (math.exp(2 * score_err / 8) - 1) * vmax + 0.01 * vmax
    body = [p for p in held_parts(cache.layer(0))[0] if p.name == "body" and p.n]
    if body and route(lib, False, body[0], row_source(body[0], None, None, []), 3, 64) == Route.INTEGER:
        assert not torch.equal(fast, exact)  # the keys took the integer route: an approximation


def test_the_integer_route_is_taken_only_where_no_exact_kernel_is_faster(lib):
    """KIVI 4-bit keys, 2-bit Lloyd-Max keys, 2-, 3- or 4-bit affine values and 2-bit Lloyd-Max
    values go the integer way on every CPU with AVX2 (VNNI -- 2-bit keys with VBMI --, or
    vpmaddubsw: score_int4, score_int2, value_bytes); 3- and 4-bit Lloyd-Max values only with
    VNNI: their levels do not hold as integers up to 16 (what byte products allow), and int16
    products are no faster than the exact kernels' FMAs without vpdpwssd, so attend_layer routes
    them to the exact kernels there."""
    hadv2, k4v3hc, k3v2lm, k4v3lmc = (
        filled(s, 100, 1)
        for s in (
            "hadv2",
            "k=int4h,v=int3h,group=64,residual=32,sinks=4,center=1",
            "k=lm3h,v=lm2h,group=64,residual=8,sinks=4",
            "k4v3lmc",
        )
    )
    lm2 = filled("k=lm2h,v=lm2h,group=64,residual=8,sinks=4,center=1", 100, 1)  # the 2-bit maps' most common layer
    features = abi.features(lib)
    vnni = "avx512_vnni" in features
    two_bit_keys = "avx512_vbmi" in features or "avx512" not in features
    for values, part, expected in (
        (False, body_part(lm2, False), Route.INTEGER if two_bit_keys else Route.TOKEN),
        (False, body_part(hadv2, False), Route.INTEGER),
        (True, body_part(hadv2, True), Route.INTEGER),
        (True, body_part(k3v2lm, True), Route.INTEGER),
        (True, body_part(k4v3hc, True), Route.INTEGER),
        (True, body_part(k4v3lmc, True), Route.INTEGER if vnni else Route.TOKEN),
    ):
        chosen = route(lib, values, part, row_source(part, None, None, []), 3, 64)
        assert chosen == expected, (values, chosen)
