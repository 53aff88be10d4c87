"""The age tier (``tier=N:CODEC``, kv/store.py): the N tokens just older than the exact residual,
held in a finer codec than the body.

    [ sinks | body (each layer's codec) | tier (N tokens, e.g. lm4hb) | residual (exact) ]

A token leaving the residual is coded into the tier; once N + unit wait there, the oldest whole
units are decoded and coded again into the body (rounded twice). Tokens that go straight to the
body in one append -- a prefill longer than residual + N -- are coded once, from exact values.
These tests hold the store to that rule written plainly over lists, its bytes to the closed form,
the kernels to the reference, and the model's decode on both backends to each other.
"""

from __future__ import annotations

import pytest
import torch

from minillama.errors import UserError
from minillama.kv.budget import formula_live_bytes
from minillama.kv.cache import KVCache
from minillama.kv.codecs import CODECS
from minillama.kv.spec import parse_kv
from minillama.model.attention import attend
from minillama.native import backend
from minillama.native.plans import fused_decode_attention, held_parts
from tests.conftest import decode_steps

TIERED = "k=lm3hb,v=lm2hb,group=32,residual=4,sinks=2,center=1,tier=12:lm4hb"
APPENDS = [30] + [1] * 20 + [5, 17] + [1] * 9  # a prefill, decode steps, short chunks


def coded(codec_name: str, x: torch.Tensor, group: int = 64) -> torch.Tensor:
    """Rows (B, H, n, D) through one codec and back, float32 (the tier: one scale a row of D)."""
    codec, d = CODECS[codec_name], x.shape[-1]
    return codec.decode(codec.encode(x, group), group, d)


def plain_tier_rule(rows: torch.Tensor, appends: list[int], residual: int, tier: int, body, tiered) -> torch.Tensor:
    """What the cache should hold of the non-sink rows (B, H, n, D), exact storage form, fed in
    `appends`: the same rule as kv/layered.py, over Python lists of single rows."""
    exact, in_tier, in_body, fed = [], [], [], 0
    for n in appends:
        exact += [rows[:, :, i : i + 1] for i in range(fed, fed + n)]
        fed += n
        leave = max(0, len(exact) - residual)
        leaving, exact = exact[:leave], exact[leave:]
        to_body = max(0, len(in_tier) + leave - tier)
        from_tier = min(to_body, len(in_tier))
        in_body += [body(t.half()) for t in in_tier[:from_tier]]  # decoded from the tier, coded again
        in_body += [body(x) for x in leaving[: to_body - from_tier]]  # straight to the body: coded once
        in_tier = in_tier[from_tier:] + [tiered(x) for x in leaving[to_body - from_tier :]]
    return torch.cat([t.float() for t in in_body + in_tier + exact], dim=2)


def fill(
    spec: str, appends: list[int], layers: int = 2, seed: int = 0, heads: int = 2, d: int = 64
) -> tuple[KVCache, list]:
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(parse_kv(spec), n_layers=layers, n_kv_heads=heads, head_dim=d, capacity=256)
    fed = []
    for n in appends:
        kv = [
            (torch.randn(1, heads, n, d, generator=g) + 3, torch.randn(1, heads, n, d, generator=g))
            for _ in range(layers)
        ]
        cache.append(kv)
        fed.append(kv)
    return cache, fed


def test_the_cache_holds_what_the_plain_rule_says():
    """Keys and values of both layers: sinks exact, then body, tier and residual as the rule above
    puts them, with the storage form (rotation, key center) taken from a cache that codes nothing."""
    cache, fed = fill(TIERED, APPENDS)
    nothing_coded = TIERED.replace(",tier=12:lm4hb", "").replace("residual=4", "residual=250")
    exact_cache = KVCache(parse_kv(nothing_coded), 2, 2, 64, 256)
    for kv in fed:
        exact_cache.append(kv)
    for layer in range(2):
        keys, values = cache.layer(layer).read(torch.float32)
        stored_k, stored_v = exact_cache.layer(layer).read(torch.float32)  # storage form, nothing coded
        for got, rows, body in ((keys, stored_k, "lm3hb"), (values, stored_v, "lm2hb")):
            nonsink = [APPENDS[0] - 2, *APPENDS[1:]]  # the first two tokens fill the sinks
            want = plain_tier_rule(
                rows[:, :, 2:], nonsink, 4, 12, lambda x, b=body: coded(b, x, 32), lambda x: coded("lm4hb", x)
            )
            assert torch.equal(got[:, :, :2], rows[:, :, :2])  # the sinks
            assert torch.allclose(got[:, :, 2:], want, atol=1e-6), layer
    store = cache.layers[0][0]
    assert (store.sinks.count, store.n_body, store.n_tier, store.residual.count) == (2, sum(APPENDS) - 18, 12, 4)


@pytest.mark.parametrize(
    "spec",
    [
        TIERED,
        "k=int4c,v=int2,group=16,residual=4,tier=8:int4",  # per-channel keys: the tier holds 8 to 8 + 15
        "k=lm2hb,v=lm2hb,group=64,residual=0,tier=30:int4h",
    ],
)
def test_bytes_equal_the_closed_form(spec):
    """The counted live bytes == kv/budget.py's formula after every append (tier codes and
    one-byte scales counted with the body's codes and scales)."""
    g = torch.Generator().manual_seed(1)
    cache = KVCache(parse_kv(spec), 2, 2, 64, 256)
    for n in APPENDS:
        cache.append([(torch.randn(1, 2, n, 64, generator=g), torch.randn(1, 2, n, 64, generator=g)) for _ in range(2)])
        assert cache.live_bytes() == formula_live_bytes(2, 2, 64, cache.spec, cache.held)


def test_the_tier_is_cheaper_than_exact_tokens_and_dearer_than_the_body():
    """Per element: lm4hb in the tier 4 + 8/64 bits, the body's lm2hb 2 + 8/64, exact fp16 16."""
    tiered, _ = fill("k=lm2hb,v=lm2hb,group=64,residual=4,tier=40:lm4hb", [200], layers=1)
    exact, _ = fill("k=lm2hb,v=lm2hb,group=64,residual=44", [200], layers=1)
    body = 200 - 44
    elements = 2 * 2 * 64  # K and V, two heads
    assert sum(tiered.live_bytes().values()) * 8 == elements * (body * 2.125 + 40 * 4.125 + 4 * 16)
    assert sum(exact.live_bytes().values()) * 8 == elements * (body * 2.125 + 44 * 16)


@pytest.mark.parametrize("spec", [TIERED, "k=int4c,v=int2,group=16,residual=4,tier=8:int4"])
@pytest.mark.parametrize("hq,hkv,d", [(6, 2, 64), (2, 2, 64), (16, 1, 64), (8, 2, 128), (4, 4, 128)])
def test_the_decode_kernels_read_the_tier_like_the_reference(lib, spec, hq, hkv, d):
    """Four parts a layer (sinks, body, tier, residual) through the fused decode attention, for
    1 to 16 query heads per KV head and head_dim 64 and 128."""
    cache, _ = fill(spec, APPENDS, heads=hkv, d=d)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, hq, 1, d, generator=g)
    k, v = torch.randn(1, hkv, 1, d, generator=g), torch.randn(1, hkv, 1, d, generator=g)
    view = cache.layer(1)
    assert [p.name for p in held_parts(view)[0]][-2:] == ["tier", "residual"]
    reference = attend(q, k, v, view.read(torch.float32), view.k_codec, view.v_codec, view.key_center)
    assert torch.allclose(fused_decode_attention(lib, q, k, v, view), reference, atol=2e-5, rtol=1e-4)


def test_the_model_decodes_a_tiered_cache_alike_on_both_backends(tiny):
    """The native step (kernels-exact: every layer's attention over four parts in C++) against the
    PyTorch layers, 30 steps after a 40-token prefill that already fills the tier."""
    with backend.using("reference"):
        reference = decode_steps(tiny, TIERED)
    before = backend.tally()
    with backend.using("kernels-exact"):
        native = decode_steps(tiny, TIERED)
    ran = backend.tally() - before
    assert ran["decode step"] == 30 and not [k for k in ran if k.startswith("fallback")]
    assert torch.allclose(native, reference, atol=1e-4)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("k=lm3hb,v=lm2hb,tier=56", "tier=N:CODEC"),
        ("k=lm3hb,v=lm2hb,tier=0:lm4hb", "tier=N:CODEC"),
        ("k=lm3hb,v=lm2hb,tier=8:int4c", "per-token"),
        ("k=lm3hb,v=lm2hb,tier=8:nope", "unknown codec"),
        ("k=fp16,v=fp16,tier=8:lm4hb", "quantized body"),
    ],
)
def test_a_bad_tier_is_refused_in_one_line(spec, message):
    with pytest.raises(UserError, match=message):
        parse_kv(spec)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("k=int4c,v=int2h,tier=8:lm4hb", "not rotated"),
        ("k=lm3hb,v=lm2hb,tier=8:int8", "rotated"),
        ("k=lm3hb,v=lm2hb,start=64,tier=8:lm4hb", "start="),
    ],
)
def test_a_tier_that_cannot_sit_beside_the_body_is_refused(spec, message):
    with pytest.raises(UserError, match=message):
        KVCache(parse_kv(spec), 1, 2, 64, 256)


def test_the_spec_names_its_tier():
    spec = parse_kv(TIERED)
    assert (spec.tier, spec.tier_codec.name) == (12, "lm4hb")
    assert parse_kv(spec.canonical()) == spec
    assert "tier=12:lm4hb" in spec.canonical()
