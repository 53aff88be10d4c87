"""Keys coded in RoPE frequency blocks (``lm{bits}f{blocks}:{widths}``), checked against the math.

A block is the channels of a run of RoPE frequencies, both halves of each rotate-half pair; each
block of each KV head is rotated on its own, coded with the Lloyd-Max book of its own width and
one byte scale. The tests rebuild that by hand -- an explicit permutation and Hadamard matrix,
block by block -- and hold the codec, the spec grammar and the cache to it.
"""

from __future__ import annotations

import pytest
import torch

from minillama.errors import UserError
from minillama.kv.cache import KVCache
from minillama.kv.quantize import (
    block_rotate,
    block_unrotate,
    dequantize_codebook,
    frequency_block_order,
    hadamard_matrix,
    quantize_codebook,
)
from minillama.kv.spec import codec_named, parse_kv
from minillama.native import backend


def by_hand(x: torch.Tensor, widths: tuple[tuple[int, ...], ...], fp16_rows: bool = False) -> torch.Tensor:
    """x (B, H, T, D) -> what the codec should give back in model space: per head, per block b of
    channels C_b (frequencies bF .. (b+1)F - 1, both pair halves), x_C_b H_n coded at its width
    with one byte scale, rotated back; a block of width 0 comes back as zeros. With `fp16_rows`
    the rotated rows are rounded to float16 first, as a cache keeps them until they are coded."""
    d, nb = x.shape[-1], len(widths[0])
    n, half, f = d // nb, d // 2, d // 2 // nb
    h_n = hadamard_matrix(n)  # (n, n) symmetric, orthonormal
    out = torch.zeros_like(x)
    for head, ws in enumerate(widths):
        for b, w in enumerate(ws):
            channels = list(range(b * f, (b + 1) * f)) + list(range(half + b * f, half + (b + 1) * f))
            y = x[:, head : head + 1, :, channels] @ h_n  # (B, 1, T, n)
            y = y.half().float() if fp16_rows else y
            if w:
                codes, scale = quantize_codebook(y, w, n, log_scale=True)
                out[:, head : head + 1, :, channels] = dequantize_codebook(codes, scale, w, n) @ h_n
    return out


def test_a_block_holds_whole_rope_pairs_of_neighbouring_frequencies():
    order = frequency_block_order(64, 4)
    assert sorted(order) == list(range(64))
    assert order[:16] == list(range(0, 8)) + list(range(32, 40))  # block 0: frequencies 0-7, both halves
    assert frequency_block_order(128, 2)[:64] == list(range(0, 32)) + list(range(64, 96))


@pytest.mark.parametrize("nb", [1, 2, 4])
def test_the_block_rotation_is_orthonormal_and_undone(nb):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g)
    rq, rk = block_rotate(q, nb), block_rotate(k, nb)
    assert torch.allclose((rq * rk).sum(-1), (q * k).sum(-1), atol=1e-5)  # scores survive the rotation
    assert torch.allclose(block_unrotate(rk, nb), k, atol=1e-6)


@pytest.mark.parametrize(
    "name, heads, d, bits",
    [
        ("lm3f2:24.15", 2, 64, 3 + 16 / 64),  # codes, plus a one-byte scale per block
        ("lm3f4:2244.3333", 2, 64, 3 + 32 / 64),
        ("lm2f2:13.22.04", 3, 128, 2 + 16 / 128),
    ],
)
def test_bits_are_the_mean_width_plus_a_byte_per_block(name, heads, d, bits):
    codec = codec_named(name)
    assert codec.body_bits(d, 64) == bits
    parts = codec.encode(codec.to_space(torch.randn(1, heads, 7, d)), 64)
    assert parts["codes"].shape == (1, heads, 7, d * codec.bits // 8)  # every head's row the same bytes
    assert parts["scale"].shape == (1, heads, 7, codec.blocks) and parts["scale"].dtype == torch.uint8


@pytest.mark.parametrize("name", ["lm3f2:24.15", "lm3f4:2244.0255", "lm4f2:44.35"])
def test_each_block_is_a_lloyd_max_code_of_its_own_width(name):
    codec = codec_named(name)
    x = torch.randn(2, 2, 9, 64, generator=torch.Generator().manual_seed(1))
    got = codec.from_space(codec.decode(codec.encode(codec.to_space(x), 64), 64, 64))
    assert torch.allclose(got, by_hand(x, codec.widths), atol=1e-5)


def test_a_block_of_width_zero_is_dropped_and_a_wide_one_is_close():
    codec = codec_named("lm3f4:0066.3333")
    x = torch.randn(1, 2, 20, 64, generator=torch.Generator().manual_seed(2))
    back = codec.from_space(codec.decode(codec.encode(codec.to_space(x), 64), 64, 64))
    block0 = frequency_block_order(64, 4)[:16]
    assert back[:, 0, :, block0].abs().max() == 0  # head 0 spends nothing on its fastest frequencies
    wide = frequency_block_order(64, 4)[32:]
    err = (back[:, 0, :, wide] - x[:, 0, :, wide]).norm() / x[:, 0, :, wide].norm()
    assert err < 0.05  # 6-bit blocks


@pytest.mark.parametrize(
    "name, error",
    [
        ("lm3f2:24.34", "adding up to 6"),
        ("lm3f2:243", "2 widths"),
        ("lm3f3:333", "1, 2, 4 or 8 blocks"),
        ("lm9f2:99", "1-8 bits"),
    ],
)
def test_a_malformed_table_is_a_clear_error(name, error):
    with pytest.raises(UserError, match=error):
        parse_kv(f"k={name},v=fp16")


def test_a_table_for_other_heads_is_refused_by_name():
    codec = codec_named("lm3f2:24.15.33")
    with pytest.raises(UserError, match="widths for 3 KV heads; this model has 2"):
        codec.encode(torch.randn(1, 2, 4, 64), 64)


def test_specs_with_block_keys_round_trip_and_mix_by_layer():
    spec = parse_kv("k=lm3f2:24.15,v=lm2hb,kgroup=32,vgroup=64,residual=8,sinks=4,center=1")
    assert parse_kv(spec.canonical()).canonical() == spec.canonical() and spec.k.widths == ((2, 4), (1, 5))
    mixed = parse_kv("k=lm3hb,v=lm2hb,group=64,layers=lm3f2:24.15/lm2hb;lm4hb/lm3hb")
    assert [k.name for k, _ in mixed.layer_codecs] == ["lm3f2:24.15", "lm4hb"]
    assert parse_kv(mixed.canonical()).layer_codecs == mixed.layer_codecs


def test_the_cache_stores_what_the_blocks_decode_to():
    """Keys through the cache (no residual, no sinks: every token coded at once) read back as the
    by-hand blocks, for a run of single tokens and for a prompt."""
    spec = parse_kv("k=lm3f2:24.15,v=fp16,residual=0")
    codec = spec.k
    k_all = torch.randn(1, 2, 40, 64, generator=torch.Generator().manual_seed(3))
    cache = KVCache(spec, n_layers=1, n_kv_heads=2, head_dim=64, capacity=64)
    cache.append([(k_all[:, :, :31], torch.randn(1, 2, 31, 64))])
    for t in range(31, 40):
        cache.append([(k_all[:, :, t : t + 1], torch.randn(1, 2, 1, 64))])
    stored = cache.layer(0).read(torch.float32)[0]  # (1, 2, 40, 64) in the codec's storage space
    expected = by_hand(k_all, codec.widths, fp16_rows=True)
    assert torch.allclose(codec.from_space(stored), expected, atol=1e-5)


@pytest.mark.skipif(backend.library() is None, reason="the kernels did not build here")
@pytest.mark.parametrize("name", ["lm4f4:0178.2356", "lm3f2:24.15"])
def test_the_native_block_write_is_the_reference_bytes(name):
    """The cache write with the kernels (native/write.py: each block through native/encode.cpp's
    Lloyd-Max encoder, widths 1-8) stores exactly the bytes the codec's own encode does, on rows
    of every scale from float16's smallest normals to wide-ranging ones and all-zero blocks."""
    from minillama.native.write import KernelWriter

    codec = codec_named(name)
    g = torch.Generator().manual_seed(len(name))
    x = torch.randn(3, 2, 64, 64, generator=g) * torch.rand(3, 2, 64, 64, generator=g).pow(6).mul(30)  # (B, H, T, D)
    x[0] *= 1e-4
    x[1, 0, :3] = 0.0
    x = codec.to_space(x).to(torch.float16)
    before = backend.tally()
    native = KernelWriter(backend.library()).encode(codec, x, 64)
    assert (backend.tally() - before)["cache encode"] == 1  # the kernels wrote it
    reference = codec.encode(x, 64)
    assert native.keys() == reference.keys() == {"codes", "scale"}
    for part in native:
        assert native[part].dtype == reference[part].dtype and torch.equal(native[part], reference[part]), part


def test_the_model_decodes_over_block_keys_on_either_backend(tiny):
    """Prefill, then 40 decode steps of the tiny model over a cache of block keys: close to the
    exact cache, and the same logits whichever backend runs (the kernels read these rows a row at
    a time and must rotate the query block by block, not by the whole-head H)."""
    from tests.test_cache import run, tokens

    t = tokens(48)
    exact = run(tiny.model, KVCache.for_model(tiny.config, parse_kv("fp32"), 64), t)
    got = {}
    for name in ("reference", "kernels"):
        with backend.using(name):
            spec = parse_kv("k=lm4f2:35.44,v=fp16,residual=8,sinks=2,center=1")
            before = backend.tally()
            got[name] = run(tiny.model, KVCache.for_model(tiny.config, spec, 128), t)
            assert (backend.tally() - before)["decode step"] == (40 if name == "kernels" else 0)
    assert (got["reference"] - exact).abs().max() <= 0.1 * exact.abs().max()
    assert torch.allclose(got["kernels"], got["reference"], atol=1e-3 * float(exact.abs().max()))
