"""Pure quantizers, packing and the Hadamard rotation, checked against the math."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillama.errors import UserError
from minillama.kv import packing, quantize
from minillama.kv.codecs import CODECS
from minillama.kv.quantize import (
    NonFiniteError,
    dequantize_affine,
    hadamard_blocks,
    hadamard_matrix,
    hadamard_rotate,
    quantize_affine,
    quantize_ternary,
)
from minillama.kv.spec import parse_kv

PACKINGS = {8: 256, 7: 128, 6: 64, 5: 32, 4: 16, 3: 8, 2: 4, 1: 2, "trit": 3}


@pytest.mark.parametrize("bits", PACKINGS)
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_pack_unpack_round_trip_every_code_value(bits, rows):
    n = 40 if bits != "trit" else 43  # 43 trits: the last byte is partly padding
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, PACKINGS[bits], (rows, n), generator=g, dtype=torch.uint8)
    codes[0, : PACKINGS[bits] if PACKINGS[bits] <= n else n] = torch.arange(min(PACKINGS[bits], n), dtype=torch.uint8)
    packed = packing.pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == packing.packed_width(n, bits)
    assert torch.equal(packing.unpack(packed, bits, n), codes)


def test_packing_is_dense():
    assert packing.packed_width(64, 4) == 32 and packing.packed_width(64, 2) == 16
    assert packing.packed_width(64, 3) == 24 and packing.packed_width(64, "trit") == 13


def relative_mse(x, y):
    return float(((x - y) ** 2).mean() / (x**2).mean())


def roundtrip(codec_name, x, group=32):
    codec = CODECS[codec_name]
    y = codec.to_space(x)
    return codec.to_space(codec.decode(codec.encode(y, group), group, x.shape[-1]))


def gaussian(outliers=False):
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    if outliers:
        x[..., 5] *= 20  # a few channels much larger than the rest, as in real keys
        x[..., 40] *= 12
    return x


# Uniform b-bit quantization of a Gaussian group of 32 over its min-max range: the step is
# ~ range/(2^b - 1) with range ~ 4.1 sigma, and the error variance step^2/12. These bounds
# are that estimate with ~50% headroom; ternary's TWN rule gives ~0.27 on Gaussians.
BOUNDS = {
    "int8": 2e-4,
    "int4": 0.02,
    "int2": 0.35,
    "int4c": 0.02,
    "int2c": 0.35,
    "int4h": 0.02,
    "int3h": 0.08,
    "int2h": 0.35,
    "tern": 0.4,
    # Lloyd-Max on N(0,1): 0.0095 (4 bits), 0.0345 (3), 0.1175 (2), plus RMS-estimate noise.
    "lm4h": 0.015,
    "lm3h": 0.05,
    "lm2h": 0.16,
    "lm4hb": 0.015,  # one-byte log scales: steps of 4.4%, the refinement picks the best grid point
    "lm3hb": 0.05,
    "lm2hb": 0.16,
    "vq2hs": 0.14,  # 4 channels a byte from a sign x 16-pattern book: ~0.103 on N(0, I)
}


@pytest.mark.parametrize("name", BOUNDS)
def test_quantization_error_is_bounded_on_gaussian_data(name):
    x = gaussian()
    assert relative_mse(x, roundtrip(name, x)) < BOUNDS[name]


@pytest.mark.parametrize("plain,rotated", [("int4", "int4h"), ("int2", "int2h")])
def test_rotation_lowers_error_on_outlier_channels(plain, rotated):
    x = gaussian(outliers=True)
    assert relative_mse(x, roundtrip(rotated, x)) < relative_mse(x, roundtrip(plain, x))


def test_gaussian_codebook_is_the_lloyd_max_quantizer():
    from minillama.kv.quantize import gaussian_codebook

    assert torch.allclose(gaussian_codebook(1), torch.tensor([-0.7979, 0.7979]), atol=1e-4)  # ±sqrt(2/pi)
    assert torch.allclose(gaussian_codebook(2), torch.tensor([-1.5104, -0.4528, 0.4528, 1.5104]), atol=1e-4)


@pytest.mark.parametrize("bits", [2, 3])
def test_codebook_beats_uniform_grid_on_rotated_gaussian_data(bits):
    # Same group (one scale per 64 channels; the codebook stores no zero point). On
    # Gaussian coordinates, the codebook's design case, it has the lower error.
    x = gaussian()
    assert relative_mse(x, roundtrip(f"lm{bits}h", x, 64)) < relative_mse(x, roundtrip(f"int{bits}h", x, 64))


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("tails", ["gaussian", "student-t3"])
def test_refined_codebook_scale_never_fits_worse_than_the_rms(bits, tails):
    """quantize_codebook refines each group's scale by alternating minimization; per
    group its squared error must not exceed the plain RMS scale's (fp16 slack allowed),
    and lower on average (most of all on heavy-tailed groups)."""
    from minillama.kv.quantize import dequantize_codebook, quantize_codebook

    g = torch.Generator().manual_seed(bits)
    x = (
        torch.randn(2000, 64, generator=g)
        if tails == "gaussian"
        else torch.distributions.StudentT(3.0).sample((2000, 64))
    )
    errors = {}
    for refine in (0, 4):
        codes, scale = quantize_codebook(x, bits, 64, refine=refine)
        errors[refine] = (dequantize_codebook(codes, scale, bits, 64) - x).pow(2).sum(-1)  # per group
    assert (errors[4] <= errors[0] * (1 + 2e-3) + 1e-6).all()
    assert errors[4].mean() < (0.995 if tails == "gaussian" else 0.97) * errors[0].mean()


def test_the_vector_codebook_is_a_gaussian_quantizer_in_float16():
    """256 distinct 4-dim vectors, stored exactly in float16, centred on the origin; on fresh
    N(0, I) samples (not the ones it was made from) their squared error per coordinate is below
    the 2-bit scalar Lloyd-Max quantizer's 0.1175 -- the reason for coding vectors at all."""
    book = quantize.gaussian_vector_codebook(4, 2)  # (256, 4)
    assert book.shape == (256, 4) and torch.equal(book, book.half().float())
    assert torch.unique(book, dim=0).shape[0] == 256
    assert book.mean(0).abs().max() < 0.05
    x = torch.randn(20000, 4, generator=torch.Generator().manual_seed(11))  # (S, 4)
    nearest = book[((x[:, None, :] - book[None]) ** 2).sum(-1).argmin(-1)]  # brute force, independent of _nearest
    assert ((nearest - x) ** 2).mean() < 0.105


def test_the_sign_structured_book_is_signs_times_sixteen_patterns():
    """vq2hs's book: vectors 0-15 are non-negative patterns, and vector 16 s + p is pattern p with
    coordinate c negated where bit c of s is set -- what the integer kernel rebuilds in
    registers; on N(0, I) it keeps most of the free book's gain over scalar levels."""
    book = quantize.gaussian_vector_codebook(4, 2)  # (256, 4)
    patterns = book[:16]  # (16, 4)
    assert (patterns >= 0).all()
    for k in range(256):
        signs = torch.tensor([-1.0 if (k >> 4) >> c & 1 else 1.0 for c in range(4)])
        assert torch.equal(book[k], patterns[k % 16] * signs)
    x = torch.randn(20000, 4, generator=torch.Generator().manual_seed(11))  # (S, 4)
    nearest = book[((x[:, None, :] - book[None]) ** 2).sum(-1).argmin(-1)]
    assert ((nearest - x) ** 2).mean() < 0.108


def test_the_sign_structured_search_finds_the_books_nearest_vector():
    """quantize_vectors searches vq2hs's book as signs x 16 patterns (the code native/encode.cpp
    reproduces): x's signs and the pattern nearest |x|. That is the nearest of all 256 vectors,
    and a zero coordinate keeps its + (the lower code, as an argmin over the whole book picks)."""
    book = quantize.gaussian_vector_codebook(4, 2)  # (256, 4)
    x = torch.randn(50000, 4, generator=torch.Generator().manual_seed(12))  # (S, 4)
    x[:100, 1] = 0.0
    codes = quantize._nearest_signed(x, quantize.vector_patterns(4, 2))
    brute = ((x[:, None, :] - book[None]) ** 2).sum(-1)  # (S, 256)
    assert torch.equal(brute.gather(1, codes[:, None]).squeeze(1), brute.min(-1).values)
    assert not (codes[:100] >> 4 >> 1 & 1).any()  # the zero coordinate: no sign bit


def test_vector_codes_beat_scalar_levels_at_equal_bits():
    """vq2hs and lm2h store the same bytes (2 bits per element + an fp16 scale per group); on
    Gaussian coordinates the vector code's error is lower by more than a tenth."""
    x = gaussian()
    assert CODECS["vq2hs"].body_bits(64, 64) == CODECS["lm2h"].body_bits(64, 64) == 2.25
    assert relative_mse(x, roundtrip("vq2hs", x, 64)) < 0.9 * relative_mse(x, roundtrip("lm2h", x, 64))


@pytest.mark.parametrize("d, g", [(64, 64), (64, 16), (128, 32), (128, 4)])
def test_vector_code_bits_are_two_plus_the_scale(d, g):
    """One byte per 4 channels and one fp16 scale per G channels: 2 + 16/G bits per element."""
    codec = CODECS["vq2hs"]
    assert codec.body_bits(d, g) == 2 + 16 / g
    parts = codec.encode(torch.randn(1, 2, 5, d), g)
    assert parts["codes"].shape == (1, 2, 5, d // 4) and parts["scale"].shape == (1, 2, 5, d // g)


def test_vector_codes_need_groups_of_whole_vectors():
    with pytest.raises(UserError, match="multiple"):
        parse_kv("k=fp16,v=vq2hs,vgroup=2").validate(64)


def test_per_channel_beats_per_token_on_outlier_channels():
    x = gaussian(outliers=True)
    assert relative_mse(x, roundtrip("int2c", x)) < relative_mse(x, roundtrip("int2", x))


def test_fp_codecs_round_trip_in_their_dtype():
    x = gaussian()
    assert torch.equal(roundtrip("fp32", x), x)
    assert torch.equal(roundtrip("bf16", x), x.to(torch.bfloat16).float())


def test_hadamard_is_orthonormal_and_self_inverse():
    for d in (1, 2, 16, 64, 80, 96, 128):
        h = hadamard_matrix(d)
        assert torch.allclose(h @ h.T, torch.eye(d), atol=1e-6)
        assert torch.allclose(h, h.T)
        x = torch.randn(5, d)
        assert torch.allclose(hadamard_rotate(x), x @ h, atol=1e-5)  # the fast transform is the matrix
        assert torch.allclose(hadamard_rotate(hadamard_rotate(x)), x, atol=1e-5)


def test_a_head_that_is_not_a_power_of_two_is_rotated_in_power_of_two_blocks():
    """80 channels: a 64-channel Hadamard block, then a 16-channel one; nothing mixes across."""
    assert hadamard_blocks(80) == [64, 16] and hadamard_blocks(96) == [64, 32] and hadamard_blocks(128) == [128]
    h = hadamard_matrix(80)
    assert torch.equal(h[:64, :64], hadamard_matrix(64)) and torch.equal(h[64:, 64:], hadamard_matrix(16))
    assert not h[:64, 64:].any() and not h[64:, :64].any()
    parse_kv("k=int4h,v=lm2h,group=16").validate(80)  # accepted, no power-of-two refusal


@pytest.mark.parametrize(
    "head_dim,group,fitted", [(80, 32, 16), (80, 64, 16), (96, 64, 32), (96, 32, 32), (64, 32, 32)]
)
def test_a_group_of_channels_that_does_not_divide_the_head_is_fitted_to_it(head_dim, group, fitted):
    """kivi4's values scale groups of 32 channels: 32 does not divide 80, so an 80-channel head gets
    16 (the largest power of two dividing both); KIVI's per-channel keys group tokens, not channels."""
    spec = parse_kv(f"k=int4c,v=int4,group={group}").fitted(head_dim)
    assert (spec.kgroup, spec.vgroup) == (group, fitted)
    spec.validate(head_dim)


def test_affine_per_channel_groups_share_scale_along_time():
    x = torch.randn(1, 1, 64, 8)
    codes, scale, zero = quantize_affine(x, 4, 32, "channel")
    assert scale.shape == (1, 1, 2, 8) and zero.shape == (1, 1, 2, 8)
    assert torch.allclose(zero[0, 0, 0].float(), x[0, 0, :32].amin(0).half().float())


@settings(max_examples=40, deadline=None)
@given(
    value=st.floats(-1e4, 1e4, allow_nan=False),
    bits=st.sampled_from([2, 3, 4, 8]),
    axis=st.sampled_from(["token", "channel"]),
)
def test_constant_groups_never_divide_by_zero(value, bits, axis):
    x = torch.full((1, 1, 32, 32), value)
    codes, scale, zero = quantize_affine(x, bits, 32, axis)
    y = dequantize_affine(codes, scale, zero, 32, axis)
    assert torch.isfinite(y).all()
    assert torch.allclose(y, torch.full_like(y, float(torch.tensor(value).half())))
    codes_t, scale_t = quantize_ternary(x, 32)
    assert torch.isfinite(scale_t.float()).all()


@settings(max_examples=30, deadline=None)
@given(bad=st.sampled_from([float("nan"), float("inf"), float("-inf")]), codec=st.sampled_from(sorted(CODECS)))
def test_non_finite_inputs_raise_a_clear_error(bad, codec):
    x = torch.randn(1, 1, 32, 64)
    x[0, 0, 3, 7] = bad
    with pytest.raises(NonFiniteError, match="NaN or inf"):
        CODECS[codec].encode(x, 32)


@settings(max_examples=60, deadline=None)
@given(
    bad=st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    where=st.integers(0, 3 * 40 * 64 - 1),
)
def test_all_finite_finds_one_bad_element_anywhere(bad, dtype, where):
    """The finiteness check the cache write runs on every block (one max, not a mask): a single
    NaN or inf anywhere, in any dtype the cache takes, is found; finite tensors and empty ones pass."""
    from minillama.kv.quantize import all_finite

    x = torch.randn(1, 3, 40, 64).mul(100).to(dtype)
    assert all_finite(x) and all_finite(x[:, :, :0])
    x.view(-1)[where] = bad
    assert not all_finite(x)


@pytest.mark.parametrize(
    "text,error",
    [
        ("int5", "unknown --kv preset"),
        ("k=int4,v=int9", "unknown codec 'int9'"),
        ("k=int4", "must name both"),
        ("k=int4,v=int4,group=-1", "must not be negative"),
        ("k=int4,v=int4,group=３２", "is not a whole number written in 0-9"),  # int() would read it as 32
        ("k=int4,v=int4,tier=５６:lm4hb", "write tier=N:CODEC"),
        ("k=int4,v=int4,group=x", "not a whole number"),
        ("k=int4,v=int4,foo=1", "malformed"),
        ("k=int4,v=int4,group=0", "at least 1"),
    ],
)
def test_bad_specs_give_clear_errors_listing_choices(text, error):
    with pytest.raises(UserError, match=error):
        parse_kv(text)


def test_group_must_divide_head_dim_for_per_token_codecs():
    """A spec checked as written refuses the group; a cache fits it first (KVSpec.fitted)."""
    with pytest.raises(UserError, match="does not divide head_dim"):
        parse_kv("k=int4,v=int4,group=24").validate(64)
    parse_kv("k=int4,v=int4,group=24").fitted(64).validate(64)  # group 8
    parse_kv("k=int4c,v=fp16,group=24").validate(64)  # per-channel groups run along time


@pytest.mark.parametrize(
    "text,hint",
    [
        ("kivi5", "did you mean kivi4"),
        ("hadv3", "did you mean hadv2"),
        ("k=int4c,v=lm2hx", "did you mean lm2h or lm2hb"),
    ],
)
def test_an_unknown_name_is_answered_with_the_nearest_ones_not_every_name(text, hint):
    with pytest.raises(UserError) as e:
        parse_kv(text)
    assert hint in str(e.value) and "k4v3lmc" not in str(e.value) and len(str(e.value)) < 160


def test_a_long_unknown_name_is_cut_in_the_error():
    with pytest.raises(UserError) as e:
        parse_kv("x" * 5000)
    assert len(str(e.value)) < 200 and "(5,000 characters)" in str(e.value)


def test_presets_are_exactly_the_documented_ones():
    spec = parse_kv("hadv2")
    assert (spec.k.name, spec.v.name, spec.kgroup, spec.residual, spec.sinks) == ("int4c", "int2h", 32, 32, 0)
    assert parse_kv("fp16").residual == 0 and parse_kv("k=int4,v=int4").residual == 32
    assert parse_kv("k=int4,v=int4,residual=0,sinks=4").sinks == 4


def test_a_preset_takes_fields_given_anew_after_its_name():
    """``PRESET,key=value``: the preset's spec with those fields replaced, named as written."""
    spec = parse_kv("hadv2,sinks=4,residual=16")
    assert spec.canonical() == parse_kv("k=int4c,v=int2h,group=32,residual=16,sinks=4").canonical()
    assert str(spec) == "hadv2,sinks=4,residual=16"
    mix = parse_kv("k3v2mixt,residual=16")  # a map keeps its layers and tier
    assert mix.tier == 56 and mix.residual == 16 and len(mix.layer_codecs) == 30


@pytest.mark.parametrize(
    "text,error",
    [
        ("hadv2,sinks=4,sinks=2", "names sinks= twice"),
        ("hadv2,junk", "expected key=value"),
        ("hadv2,foo=1", "malformed"),
    ],
)
def test_a_preset_with_a_bad_field_is_refused_in_one_line(text, error):
    with pytest.raises(UserError, match=error):
        parse_kv(text)


def test_all_codec_pairs_parse():
    for k, v in itertools.product(CODECS, repeat=2):
        parse_kv(f"k={k},v={v}").validate(64)


def test_one_byte_log_scales_are_the_grid_2_to_the_k_over_16():
    """Byte u stands for 2^((u - 128) / 16): 1 at 128, 4.4% steps, 2^-8 .. 2^(127/16); a scale is
    stored as the grid point nearest it in log terms, and a scale that is not > 0 as the smallest."""
    from minillama.kv.quantize import log_scale_code, log_scales, stored_log8

    t = log_scales()
    assert t.dtype == torch.float32 and t.shape == (256,)
    assert t[128] == 1.0 and t[0] == 2.0**-8 and t[144] == 2.0
    assert torch.allclose(t, torch.exp2((torch.arange(256) - 128) / 16.0), rtol=1e-7)
    s = torch.exp2(torch.empty(10_000).uniform_(-7.9, 7.9, generator=torch.Generator().manual_seed(3)))
    u = log_scale_code(s)
    assert torch.equal(u.long(), torch.round(torch.log2(s.double()) * 16).long() + 128)
    assert torch.equal(stored_log8(s), t[u.long()].double())
    assert log_scale_code(torch.tensor([0.0, -1.0, 1e-9, 1e9])).tolist() == [0, 0, 0, 255]


@pytest.mark.parametrize("name", ["lm2h", "lm3h", "lm4h", "lm2hb", "lm3hb", "lm4hb"])
def test_an_all_zero_group_decodes_to_almost_zero(name):
    """A Lloyd-Max book has no zero level, so a group of zeros decodes to its smallest level times
    the stored scale: that scale is the smallest the form holds (2^-24 as fp16, 2^-8 as a byte),
    never 1, so zeros come back as zeros to within max |level| x that scale. Other groups of the
    same rows are untouched by it."""
    from minillama.kv.quantize import gaussian_codebook

    codec = CODECS[name]
    x = gaussian()[:, :, :4]  # (B, H, 4, D)
    x[:, :, 1:3, :16] = 0.0  # every first group of two tokens
    back = codec.decode(codec.encode(x, 16), 16, x.shape[-1])
    smallest = 2.0**-8 if codec.log_scale else 2.0**-24
    assert back[:, :, 1:3, :16].abs().max() <= gaussian_codebook(codec.bits).abs().max() * smallest
    assert (back[:, :, 1:3, 16:] - x[:, :, 1:3, 16:]).norm() < 0.5 * x[:, :, 1:3, 16:].norm()


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group", [16, 64])
def test_a_one_byte_scale_costs_half_the_fp16_scales_bits(bits, group):
    """lm{b}hb stores lm{b}h's codes and one byte per group instead of two: b + 8/G bits/element
    against b + 16/G, and the scale part is uint8."""
    fp16, byte = CODECS[f"lm{bits}h"], CODECS[f"lm{bits}hb"]
    assert byte.body_bits(64, group) == bits + 8 / group
    assert fp16.body_bits(64, group) == bits + 16 / group
    assert [p.dtype for p in byte.parts(64, group)] == [torch.uint8, torch.uint8]
    x = gaussian()
    parts = byte.encode(byte.to_space(x), group)
    assert parts["scale"].dtype == torch.uint8 and parts["scale"].shape == (2, 3, 64, 64 // group)
    # the error of the coarser scale (4.4% steps) shows more the finer the levels: here +0.3%
    # (2 bits), +2% (3) and +7% (4) over the fp16 scale's, never less than it
    ratio = relative_mse(x, roundtrip(f"lm{bits}hb", x, group)) / relative_mse(x, roundtrip(f"lm{bits}h", x, group))
    assert 1.0 < ratio < {2: 1.01, 3: 1.04, 4: 1.10}[bits]
