"""Dense-and-sparse outliers (``{codec}o{N}``, ``outliers=N``; kv/outliers.py): each row's N
largest entries, in the model's own channels, kept exact beside a dense code.

    stored:   dense code of (x - o) H      + N x (one-byte channel index, fp16 value)
    decoded:  dense decode                 + o H            (H: the codec's Hadamard rotation)

These tests hold the split to its definition, the bytes to the closed form (24 bits an outlier),
the kernels (which add q . o to the scores and p o H to the values, native/outliers.h) to the
reference, the model's decode on both backends to each other, and the spec and file to their names.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minillama.errors import UserError
from minillama.kv import file as cache_file
from minillama.kv.budget import formula_live_bytes
from minillama.kv.cache import KVCache
from minillama.kv.fused_attention import attend_one_part, fused_decode_attention
from minillama.kv.quantize import hadamard_rotate, outlier_rows, split_outliers
from minillama.kv.spec import codec_named, parse_kv
from minillama.model.attention import attend
from minillama.model.rope import RotaryTable
from minillama.native import backend
from minillama.native.abi import NotSupported, Route
from tests.conftest import decode_on_both_backends

SPIKY = "k=lm3hb,v=lm2hb,group=64,residual=4,sinks=2,center=1,outliers=1"
SPECS = [
    SPIKY,
    "k=int4,v=int2,group=32,residual=4,outliers=2",  # unrotated codecs: the sparse part as it is
    "k=lm3hbo1,v=lm2hb,group=64,residual=4,sinks=2,center=1,tier=12:lm4hb",  # keys only, beside a tier
    "k=lm2hb,v=vq2hs,group=64,residual=4,voutliers=1",  # values only, beside vector codes
]
APPENDS = [60, 1, 1, 33, 1, 5]


def spiky(g: torch.Generator, heads: int, n: int, d: int) -> torch.Tensor:
    """Keys (1, heads, n, d) with one channel ten times the others', as real keys have."""
    x = torch.randn(1, heads, n, d, generator=g)
    x[..., 3] *= 10
    return x


def fill(spec: str, heads: int = 2, d: int = 64, layers: int = 1) -> KVCache:
    cache = KVCache(parse_kv(spec), n_layers=layers, n_kv_heads=heads, head_dim=d, capacity=256)
    g = torch.Generator().manual_seed(0)
    for n in APPENDS:
        cache.append([(spiky(g, heads, n, d), spiky(g, heads, n, d)) for _ in range(layers)])
    return cache


@pytest.mark.parametrize("rotated", [True, False])
def test_the_split_keeps_each_rows_largest_entries_exactly(rotated):
    """In the model's channels (x H for a rotated codec) the kept entries are each row's largest
    by magnitude, as fp16, indices ascending; rest + the sparse rows give x back."""
    g = torch.Generator().manual_seed(0)
    u = spiky(g, 2, 7, 64)  # the model's channels
    x = hadamard_rotate(u) if rotated else u  # (1, 2, 7, 64) in storage space
    rest, idx, val = split_outliers(x, 2, rotated)
    assert idx.dtype == torch.uint8 and val.dtype == torch.float16 and idx.shape == (1, 2, 7, 2)
    unrotated = hadamard_rotate(x) if rotated else x
    largest = unrotated.abs().topk(2, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(idx.long(), largest)
    assert torch.equal(val, unrotated.gather(-1, largest).half())
    assert torch.allclose(rest + outlier_rows(idx, val, 64, rotated), x, atol=1e-5)


def test_the_outliers_take_the_spike_out_of_the_dense_code():
    """A row with one channel ten times the others: keeping that entry exact about halves the
    code's error (rotated, it no longer stretches every coordinate's scale)."""
    codec = codec_named("lm3hbo1")
    x = hadamard_rotate(spiky(torch.Generator().manual_seed(1), 2, 50, 64))  # storage space
    err = {c.name: (c.decode(c.encode(x, 64), 64, 64) - x).pow(2).mean() for c in (codec, codec.base)}
    assert err["lm3hbo1"] < err["lm3hb"] * 0.6


@pytest.mark.parametrize("spec", SPECS)
def test_bytes_equal_the_closed_form(spec):
    """The counted live bytes == kv/budget.py's formula after every append (the outliers' indices
    and values counted with the codes)."""
    cache = KVCache(parse_kv(spec), 2, 2, 64, 256)
    g = torch.Generator().manual_seed(1)
    for n in APPENDS:
        cache.append([(spiky(g, 2, n, 64), spiky(g, 2, n, 64)) for _ in range(2)])
        assert cache.live_bytes() == formula_live_bytes(2, 2, 64, cache.spec, cache.held)


def test_an_outlier_costs_24_bits_a_row():
    """Per element of the body: lm3hb 3 + 8/64 bits, with one outlier a row 3 + 8/64 + 24/64."""
    plain, sparse = (fill(s.replace(",outliers=1", extra)) for s, extra in ((SPIKY, ""), (SPIKY, ",koutliers=1")))
    body = sum(APPENDS) - 2 - 4  # tokens in the body: all but the sinks and the residual
    assert sum(sparse.live_bytes().values()) - sum(plain.live_bytes().values()) == 2 * body * 24 // 8


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("hq,hkv,d", [(2, 2, 64), (6, 2, 64), (16, 1, 64), (8, 2, 128), (3, 1, 128)])
def test_the_decode_kernels_read_outliers_like_the_reference(lib, spec, hq, hkv, d):
    """The exact kernels (each build target) over every part, the sparse part added to the
    dense one's scores and values, for 1 to 16 query heads per KV head, head_dim 64 and 128."""
    cache = fill(spec, hkv, d)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, hq, 1, d, generator=g)
    k, v = torch.randn(1, hkv, 1, d, generator=g), torch.randn(1, hkv, 1, d, generator=g)
    view = cache.layer(0)
    reference = attend(q, k, v, view.read(torch.float32), view.k_codec, view.v_codec, view.key_center)
    assert torch.allclose(fused_decode_attention(lib, q, k, v, view), reference, atol=2e-5, rtol=1e-4)


def test_the_integer_route_adds_the_sparse_part_exactly():
    """The body's scores through the integer kernel with the outliers, less the same codes
    without them, are q . o exactly (to float rounding): the sparse part is added in float.
    4-bit Lloyd-Max keys: the integer kernels of AVX-512 VNNI and of AVX2 both read them."""
    with backend.using("kernels"):
        lib = backend.library()
        if lib is None:
            pytest.skip(f"the kernels are not available here: {backend.describe()}")
        cache = fill("k=lm4hb,v=lm2hb,group=64,residual=4,sinks=2,center=1,koutliers=1", 2, 64)
        body = next(p for p in cache.layer(0).parts()[0] if p.name == "body")
        dense = dataclasses.replace(
            body, codec=body.codec.base, rings={n: r for n, r in body.rings.items() if n not in ("oidx", "oval")}
        )
        q = torch.randn(1, 2, 3, 64, generator=torch.Generator().manual_seed(3))  # (B, H, R, D) in storage space
        with_outliers, without = torch.zeros(1, 2, 3, body.n), torch.zeros(1, 2, 3, body.n)
        try:
            attend_one_part(lib, False, body, q, with_outliers, via=Route.INTEGER)
        except NotSupported as e:  # a CPU without AVX2: no integer kernel
            pytest.skip(f"no integer kernel reads these keys here: {e}")
        attend_one_part(lib, False, dense, q, without, via=Route.INTEGER)
    keys = cache.layers[0][0].body  # layer 0's keys: each part's ring, rows in age order
    sparse = outlier_rows(keys["oidx"].read(), keys["oval"].read(), 64, True)  # (1, 2, n, 64)
    expected = q @ sparse.transpose(-1, -2)  # (1, 2, 3, n)
    assert expected.abs().max() > 1  # the spike matters
    assert torch.allclose(with_outliers - without, expected, atol=1e-4)


def test_the_model_decodes_an_outlier_cache_alike_on_both_backends(tiny):
    """The native step (kernels-exact; the cache write takes the PyTorch append)
    against the PyTorch layers, 30 steps after a 40-token prefill."""
    spec = "k=lm3hb,v=lm2hb,group=32,residual=4,sinks=2,center=1,outliers=1,tier=12:lm4hb"
    reference, native = decode_on_both_backends(tiny, spec)
    assert torch.allclose(native, reference, atol=1e-4)


def test_no_kernel_adds_outliers_to_keys_rotated_for_their_positions(lib):
    """Keys stored before RoPE are rotated for their positions as they are read; the sparse part
    is not, so the kernels refuse such a part (the step then takes the reference attention)."""
    cache = fill("k=int4,v=int2,group=32,residual=4,rope=pre,koutliers=1")
    q, k, v = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64)
    rotary = RotaryTable(1.0 / 10000 ** (torch.arange(0, 64, 2) / 64))
    with pytest.raises(NotSupported, match="int4o1 body"):
        fused_decode_attention(lib, q, k, v, cache.layer(0), rope=rotary.halves)


def test_a_saved_cache_keeps_its_outliers(tmp_path):
    cache = fill(SPIKY, layers=2)
    path = tmp_path / "c.mlkv"
    cache_file.save(cache, path, list(range(cache.position)), {"config": {}, "dtype": "float32"})
    loaded = cache_file.restore(cache_file.read(path), None, cache.spec.canonical(), 256)
    for i in range(2):
        for a, b in zip(cache.layer(i).read(torch.float32), loaded.layer(i).read(torch.float32)):
            assert torch.equal(a, b)


def test_the_spec_spells_outliers_by_codec_name():
    """outliers=N is shorthand for every quantized codec named with oN; the canonical form names them."""
    spec = parse_kv("k=lm3hb,v=lm2hb,group=64,residual=8,outliers=1,layers=lm3hb/lm2hb;lm4hb/fp16")
    assert [(k.name, v.name) for k, v in spec.layer_codecs] == [("lm3hbo1", "lm2hbo1"), ("lm4hbo1", "fp16")]
    assert parse_kv(spec.canonical()).canonical() == spec.canonical()
    assert parse_kv("k=lm3hb,v=lm2hb,koutliers=2").v.name == "lm2hb"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("k=int4co1,v=int2", "per-token quantized codec"),  # per-channel keys code along time
        ("k=nuq3o1,v=int2", "per-token quantized codec"),  # ranges fitted per sequence
        ("k=lm3hbo1o1,v=int2", "unknown codec"),  # one set of outliers a codec
        ("k=lm3hb,v=lm2hb,outliers=32", "more than twice the count"),
        ("k=lm3hb,v=lm2hb,outliers=x", "whole number"),
    ],
)
def test_outliers_a_codec_cannot_take_are_refused_in_one_line(spec, message):
    with pytest.raises(UserError, match=message):
        KVCache(parse_kv(spec), 1, 2, 64, 64)
