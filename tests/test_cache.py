"""The KV ring buffer: exactness, KIVI flushing, eviction, and byte accounting."""

from __future__ import annotations

import os

import pytest
import torch

from minillama.errors import UserError
from minillama.eval.synthetic import fill_synthetic
from minillama.kv.budget import formula_live_bytes
from minillama.kv.cache import ContextFullError, KVCache
from minillama.kv.codecs import CODECS, FloatCodec
from minillama.kv.layered import LayeredStore
from minillama.kv.memory import HUGE_PAGE
from minillama.kv.quantize import dequantize_affine, quantize_affine
from minillama.kv.ring import ring_buffer
from minillama.kv.spec import PRESETS, parse_kv
from minillama.native import backend
from minillama.native.build import TARGETS, build
from minillama.native.fast import load_model
from minillama.native.token_write import CacheWrites
from minillama.native.write import writer
from tests.conftest import make_tiny
from tests.fakes import ListCache

needs_kernels = pytest.mark.skipif(backend.library() is None, reason="the kernels did not build here")


@torch.inference_mode()  # as generation runs: the native decode step runs only without autograd
def run(model, cache, tokens, prefill=8):
    outs = [model(tokens[:, :prefill], cache)]
    outs += [model(tokens[:, i : i + 1], cache) for i in range(prefill, tokens.shape[1])]
    return torch.cat(outs, dim=1)


def tokens(n, seed=0, batch=1):
    return torch.randint(0, 300, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_fp32_preset_reproduces_a_plain_list_cache_bit_for_bit(tiny):
    # The reference path; the kernels are held to it in test_fused.py.
    t = tokens(40)
    cfg = tiny.config
    with backend.using("reference"):
        ours = run(tiny.model, KVCache.for_model(cfg, parse_kv("fp32"), 64), t)
        plain = run(tiny.model, ListCache(cfg.num_hidden_layers, cfg.n_kv_heads, cfg.head_dim), t)
    assert torch.equal(ours, plain)


def test_rotated_space_attention_equals_plain_attention_when_storage_is_exact(tiny):
    # Hadamard "storage" with exact float codes: k=fp32 rotated is emulated by spec fields.
    t = tokens(30)
    plain = run(tiny.model, KVCache.for_model(tiny.config, parse_kv("fp32"), 64), t)
    rotated = KVCache.for_model(tiny.config, parse_kv("fp32"), 64)
    rot = FloatCodec("fp32", 32, rotate=True, dtype=torch.float32)
    rotated.spec = rotated.spec.__class__(rot, rot, 32, 0, 0, "fp32-rotated")
    for pair in rotated.layers:
        for store in pair:
            store.codec = rot
    assert torch.allclose(run(tiny.model, rotated, t), plain, atol=1e-5)


@pytest.mark.parametrize("name", ["reference", "kernels"])
def test_centering_keys_leaves_attention_unchanged_when_storage_is_exact(tiny, name):
    """Subtracting one per-channel mean from every key shifts all scores of a query
    equally, so softmax (and the logits) must not move. Chunked prefill included."""
    t = tokens(40, seed=5)
    with backend.using(name):
        plain = run(tiny.model, KVCache.for_model(tiny.config, parse_kv("fp32"), 64), t)
        cache = KVCache.for_model(tiny.config, parse_kv("k=fp32,v=fp32,center=1"), 64)
        centered = torch.cat(
            [
                tiny.model(t[:, :5], cache),
                tiny.model(t[:, 5:12], cache),
                *[tiny.model(t[:, i : i + 1], cache) for i in range(12, 40)],
            ],
            dim=1,
        )
    assert torch.allclose(centered, plain, atol=1e-5)
    center = cache.layer(0).key_center  # (B, H, 1, D): the mean of the first chunk's keys
    assert center.shape == (1, tiny.config.n_kv_heads, 1, tiny.config.head_dim) and center.abs().sum() > 0


def test_centering_shrinks_the_range_of_keys_with_a_constant_offset():
    """Keys = offset + noise: centered, they are stored as noise (what makes codes finer)."""
    cache = KVCache(parse_kv("k=fp32,v=fp32,center=1"), 1, 1, 8, 64)
    g = torch.Generator().manual_seed(0)
    offset = torch.tensor([20.0, -15, 0, 0, 0, 0, 0, 30])
    k = offset + torch.randn(1, 1, 32, 8, generator=g)
    cache.append([(k, torch.zeros(1, 1, 32, 8))])
    stored, _ = cache.layer(0).read(torch.float32)
    assert stored.abs().max() < 5 and torch.allclose(stored + cache.layer(0).key_center, k, atol=1e-5)


# The largest logit error of each preset over 40 decode steps of the tiny model, relative to
# the largest |logit|, about 3x what was measured on both backends (in brackets).
MAX_RELATIVE_ERROR = {
    "fp32": 1e-6,
    "bf16": 4e-3,
    "fp16": 5e-4,
    "int8": 3e-3,  # [0, 1.3e-3, 1.7e-4, 9.1e-4]
    "kivi4": 0.05,
    "kivi2": 0.35,
    "hadv2": 0.25,
    "ternary": 0.32,  # [0.016, 0.115, 0.083, 0.106]
    "k4v3lmc": 0.27,
    "k3v2auto": 0.6,
}


def test_every_preset_has_an_error_bound():
    assert set(MAX_RELATIVE_ERROR) == set(PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_decodes_close_to_exact(tiny, preset, each_backend):
    t = tokens(48)
    exact = run(tiny.model, KVCache.for_model(tiny.config, parse_kv("fp32"), 64), t)
    got = run(tiny.model, KVCache.for_model(tiny.config, parse_kv(preset), 128), t)
    assert torch.isfinite(got).all()
    assert (got - exact).abs().max() <= MAX_RELATIVE_ERROR[preset] * exact.abs().max()


def reference_kivi_keys(k_all, residual, group, bits=4):
    """KIVI's rule written directly: all but the newest (residual + r) tokens, r < group,
    are quantized in whole groups along time, per channel; the rest stay exact (fp16)."""

    n = k_all.shape[2]
    n_q = max(0, (n - residual) // group * group)
    k_all = k_all.half()  # the cache keeps exact tokens in fp16 and quantizes those
    codes, scale, zero = quantize_affine(k_all[:, :, :n_q], bits, group, "channel")
    deq = dequantize_affine(codes, scale, zero, group, "channel")
    return torch.cat([deq, k_all[:, :, n_q:].half().float()], dim=2), n - n_q


@pytest.mark.parametrize("chunks", [[1] * 100, [37, 1, 1, 50, 11], [100]])
def test_kivi_key_flushing_matches_direct_rule(chunks):
    spec = parse_kv("k=int4c,v=int4,group=32,residual=32")
    cache = KVCache(spec, n_layers=1, n_kv_heads=2, head_dim=64, capacity=256)
    k_all = torch.randn(1, 2, sum(chunks), 64, generator=torch.Generator().manual_seed(0))
    done = 0
    for n in chunks:
        cache.append([(k_all[:, :, done : done + n], torch.randn(1, 2, n, 64))])
        done += n
        res = cache.layers[0][0].residual.count
        if done >= 32:
            assert 32 <= res <= 32 + 31
        expected, expected_res = reference_kivi_keys(k_all[:, :, :done], 32, 32)
        assert res == expected_res
        assert torch.equal(cache.layer(0).read(torch.float32)[0], expected)


def test_per_token_values_leave_the_residual_one_at_a_time():
    cache = KVCache(parse_kv("kivi4"), n_layers=1, n_kv_heads=1, head_dim=64, capacity=256)
    fill_synthetic(cache, 100, chunk=1)
    k_store, v_store = cache.layers[0]
    assert v_store.residual.count == 32 and k_store.residual.count == 32 + (100 - 32) % 32


def one_layer_model(tmp_path):
    # With one layer a token's K/V depend only on the token and its position, so a cache
    # rebuilt from the kept tokens must hold exactly the same keys and values.
    return load_model(str(make_tiny(tmp_path / "one", num_hidden_layers=1)))


@pytest.mark.parametrize(
    "spec",
    [
        "fp32",
        "k=fp32,v=fp32,sinks=4",
        "k=int4,v=int2h,residual=0,sinks=3",
        "k=int4c,v=int4,group=8,residual=8,sinks=4",
        "k=fp32,v=fp32,sinks=2,center=1",
    ],
)
def test_ring_keeps_sinks_and_newest_tokens_and_equals_a_fresh_cache(tmp_path, spec):
    lm = one_layer_model(tmp_path)
    parsed, capacity = parse_kv(spec), 48
    cache = KVCache.for_model(lm.config, parsed, capacity)
    t = tokens(130, seed=3)
    for i in range(129):
        lm.model(t[:, i : i + 1], cache)
    assert cache.held <= capacity and cache.evicted == 129 - cache.held and cache.position == 129
    assert cache.evicted % parsed.unit == 0  # whole groups are evicted
    sinks, kept = parsed.sinks, cache.held - parsed.sinks
    assert kept >= capacity - sinks - parsed.unit  # nothing is evicted before it must be
    fresh = KVCache.for_model(lm.config, parsed, capacity)
    if sinks:
        lm.model(t[:, :sinks], fresh)
    fresh.seek(129 - kept)
    lm.model(t[:, 129 - kept : 129], fresh)
    assert fresh.held == cache.held and fresh.position == cache.position
    a, b = lm.model(t[:, 129:130], cache), lm.model(t[:, 129:130], fresh)
    assert torch.allclose(a, b, atol=1e-5)


def test_on_full_stop_refuses_to_evict(tiny):
    cache = KVCache.for_model(tiny.config, parse_kv("fp32"), 10, on_full="stop")
    tiny.model(tokens(10), cache)
    with pytest.raises(ContextFullError, match="context full"):
        tiny.model(tokens(1), cache)
    assert cache.held == 10 and cache.position == 10  # nothing was changed


def test_capacity_too_small_is_a_clear_error():
    with pytest.raises(UserError, match="too small"):
        KVCache(parse_kv("hadv2"), 1, 1, 64, capacity=40)


@pytest.mark.parametrize(
    "preset",
    list(PRESETS)
    + [
        "k=int4h,v=tern,group=16,residual=8,sinks=4",
        "k=lm3h,v=int4c,group=16,residual=8,sinks=2,center=1",
        "k=int4c,v=int2,kgroup=32,vgroup=16,residual=8,sinks=4,start=40",
        "k=int4,v=int2c,group=16,residual=3,rope=pre,positions=cache",
        "k=int2c,v=int2h,kgroup=16,vgroup=64,residual=4,center=1,rope=pre",
        "k=lm3h,v=vq2hs,group=16,residual=8,sinks=4",
        "k=lm3f2:24.15,v=lm2hb,kgroup=32,vgroup=64,residual=8,sinks=4,center=1",  # frequency-block keys
    ],
)
@pytest.mark.parametrize("batch", [1, 3])
def test_byte_counters_equal_the_closed_form(tiny, preset, batch):
    spec = parse_kv(preset)
    cfg = tiny.config
    for n in (1, 31, 32, 70, 129):
        cache = KVCache.for_model(cfg, spec, 256, batch=batch)
        fill_synthetic(cache, n, chunk=17)
        assert cache.live_bytes() == formula_live_bytes(  # cache.spec: with bits=auto, the layers it chose
            cfg.num_hidden_layers, cfg.n_kv_heads, cfg.head_dim, cache.spec, n, batch
        )
        bits = (
            8
            * sum(cache.live_bytes().values())
            / (cfg.num_hidden_layers * 2 * cfg.n_kv_heads * cfg.head_dim * n * batch)
        )
        assert cache.bits_per_element() == pytest.approx(bits)


def test_hadv2_bytes_per_token_on_a_head_dim_64_model():
    # The worked example: K 32 + 8 bytes, V 16 + 8 bytes per token per KV head,
    # the residual 128 bytes per token per head each (fp16, head_dim 64).
    spec = parse_kv("hadv2")
    cache = KVCache(spec, n_layers=1, n_kv_heads=1, head_dim=64, capacity=4096)
    fill_synthetic(cache, 32 + 32 * 10)
    live = cache.live_bytes()
    assert live["codes"] == 320 * (32 + 16) and live["scales"] == 320 * (8 + 8)
    assert live["residual"] == 32 * 128 * 2


# Every preset's bytes per token per KV head at head_dim 64, written out by hand from its format:
# (key codes, key scales + zeros, value codes, value scales + zeros, residual R, sinks S, key unit, centered).
# Scales and zeros are fp16; a group of G channels has one of each per token (4 bytes), a KIVI key
# group of 32 tokens one of each per channel (64 x 4 bytes / 32 tokens = 8 per token); Lloyd-Max and
# ternary keep only a scale; 64 trits take ceil(64 / 5) = 13 bytes; residual and sinks are fp16
# rows (128 bytes); a key center is one fp16 row per head.
BY_HAND = {
    "fp32": (256, 0, 256, 0, 0, 0, 1, False),
    "bf16": (128, 0, 128, 0, 0, 0, 1, False),
    "fp16": (128, 0, 128, 0, 0, 0, 1, False),
    "int8": (64, 8, 64, 8, 32, 0, 1, False),  # groups of 32 channels: 2 x (scale + zero) = 8
    "kivi4": (32, 8, 32, 8, 32, 0, 32, False),
    "kivi2": (16, 8, 16, 8, 32, 0, 32, False),
    "hadv2": (32, 8, 16, 8, 32, 0, 32, False),
    "ternary": (32, 8, 13, 4, 32, 0, 32, False),
    "k4v3lmc": (32, 2, 24, 2, 8, 4, 1, True),  # group 64: one fp16 scale per token
    "hadv2,sinks=4": (32, 8, 16, 8, 32, 4, 32, False),
    "k=int4h,v=int4h,group=64,residual=32,sinks=4": (32, 4, 32, 4, 32, 4, 1, False),  # one scale + zero a token
    "k=lm3h,v=lm2h,group=64,residual=8,sinks=4": (24, 2, 16, 2, 8, 4, 1, False),
}


def test_every_preset_but_the_chosen_one_has_its_bytes_written_by_hand():
    """k3v2auto's codecs are chosen per sequence: tests/test_auto.py holds its bytes to the chosen mix."""
    assert set(PRESETS) - set(BY_HAND) == {"k3v2auto"}


@pytest.mark.parametrize("preset", BY_HAND)
@pytest.mark.parametrize("n", [1, 31, 40, 100, 129])
def test_every_preset_holds_the_bytes_its_format_says(preset, n):
    """2 layers x 2 KV heads x batch 3: the counters equal the hand-written bytes per token, with
    KIVI's rule for what stays in the residual (keys leave it in whole groups of 32 tokens)."""
    kc, ks, vc, vs, residual, sinks, unit, centered = BY_HAND[preset]
    cache = KVCache(parse_kv(preset), n_layers=2, n_kv_heads=2, head_dim=64, capacity=256, batch=3)
    fill_synthetic(cache, n, chunk=17)
    held_sinks = min(sinks, n)
    rest = n - held_sinks
    k_body = max(0, rest - residual) // unit * unit
    v_body = max(0, rest - residual)
    exact_row = 128 if residual or sinks else 0  # fp16 rows; float presets keep everything as "codes"
    per_head = {
        "codes": k_body * kc + v_body * vc,
        "scales": k_body * ks + v_body * vs + 128 * centered,
        "residual": (2 * rest - k_body - v_body) * exact_row,
        "sinks": 2 * held_sinks * exact_row,
    }
    assert cache.live_bytes() == {part: 2 * 2 * 3 * b for part, b in per_head.items()}


def test_decode_step_counts_bytes_read_and_written(tiny):
    spec = parse_kv("hadv2")
    cache = KVCache.for_model(tiny.config, spec, 256)
    tiny.model(tokens(40), cache)  # K residual 40, V residual 32 + 8 flushed tokens
    before = sum(cache.live_bytes().values())
    tiny.model(tokens(1), cache)  # V flushes one token; K only grows its residual
    cfg = tiny.config
    heads = cfg.num_hidden_layers * cfg.n_kv_heads
    residual_row = heads * cfg.head_dim * 2
    v_row = heads * CODECS["int2h"].bytes_per_token(cfg.head_dim, 32)
    assert cache.bytes.last_read == before + residual_row  # all held bytes + the V token leaving the residual
    assert cache.bytes.last_written == 2 * residual_row + v_row
    assert cache.bytes.total_written >= cache.bytes.last_written


def test_allocated_bytes_cover_capacity_and_never_grow(tiny):
    cache = KVCache.for_model(tiny.config, parse_kv("kivi4"), 128)
    allocated = cache.allocated_bytes()
    fill_synthetic(cache, 300, chunk=7)
    assert cache.allocated_bytes() == allocated and cache.evicted > 0


def test_truncate_keeps_a_prefix_and_cuts_groups_whole(tiny):
    cache = KVCache.for_model(tiny.config, parse_kv("k=int4c,v=int4,group=8,residual=8"), 128)
    fill_synthetic(cache, 60)
    assert cache.truncate(50) == 50  # inside the residual: exact
    assert cache.truncate(13) == 8  # cuts a quantized key group: back to its start
    assert cache.held == 8 and cache.position == 8


@pytest.mark.parametrize(
    "spec",
    [
        "fp16",
        "kivi4",
        "hadv2",
        "k4v3lmc",
        "k=int4h,v=int2h,group=64,center=1",
        "k=lm3h,v=tern,group=16,residual=3,sinks=2",
    ],
)
def test_appending_all_layers_at_once_equals_one_layer_at_a_time(spec):
    """KVCache.append quantizes every layer in one batch; storing each layer on its own
    (a LayeredStore of one layer) must leave exactly the same bytes in every ring."""
    parsed = parse_kv(spec)
    batched = KVCache(parsed, n_layers=3, n_kv_heads=2, head_dim=64, capacity=96)
    single = KVCache(parsed, n_layers=3, n_kv_heads=2, head_dim=64, capacity=96)
    single_layers = [  # each layer's K and V stored on their own
        tuple(LayeredStore([i], c, g, parsed, 96, 1, 2, 64, "cpu", centered) for c, g, centered in parsed.tensors(i))
        for i in range(3)
    ]
    single.layers = [tuple(s.stores[0] for s in pair) for pair in single_layers]
    g = torch.Generator().manual_seed(7)
    for n in [20, 1, 1, 33, 1, 50, 1]:  # wraps the ring (capacity 96)
        new_kv = [(torch.randn(1, 2, n, 64, generator=g) * 3, torch.randn(1, 2, n, 64, generator=g)) for _ in range(3)]
        batched.append(new_kv)
        evict = batched.evicted - single.evicted
        for (ks, vs), (k, v) in zip(single_layers, new_kv):
            ks.append(k[None], evict)
            vs.append(v[None], evict)
        single.position, single.evicted = batched.position, batched.evicted
    for pair_a, pair_b in zip(batched.layers, single.layers):
        for a, b in zip(pair_a, pair_b):
            assert a.held == b.held and a.n_body == b.n_body
            rings_a = [a.sinks, a.residual, *a.body.values()]
            rings_b = [b.sinks, b.residual, *b.body.values()]
            for ra, rb in zip(rings_a, rings_b):
                assert ra.start == rb.start and ra.count == rb.count and torch.equal(ra.read(), rb.read())


@pytest.mark.parametrize("preset", list(PRESETS) + ["k=int4h,v=tern,group=16,residual=8,sinks=4"])
def test_allocated_bytes_equal_the_closed_form_before_anything_is_written(preset):
    from minillama.kv.store import allocation_bytes

    spec = parse_kv(preset)
    cache = KVCache(spec, n_layers=3, n_kv_heads=2, head_dim=64, capacity=300, batch=2)
    per_head = sum(allocation_bytes(codec, group, spec, 300, 64) for codec, group, _ in spec.tensors())
    assert cache.allocated_bytes() == 3 * 2 * 2 * per_head


def test_a_cache_too_big_for_memory_is_refused_before_anything_is_allocated(monkeypatch):
    def no_allocation(*args, **kwargs):
        raise AssertionError("a ring was allocated")

    monkeypatch.setattr("minillama.kv.store.Ring", no_allocation)
    with pytest.raises(UserError, match=r"needs 4,608,000,000,000 bytes .* lower --ctx or pick a smaller --kv"):
        KVCache(parse_kv("fp32"), n_layers=30, n_kv_heads=3, head_dim=64, capacity=100_000_000)


WRITE_SPECS = [
    "kivi4",
    "hadv2",
    "k=int4h,v=int2h,group=64,residual=32,sinks=4,center=1",
    "kivi2",
    "int8",
    "fp16",
    "k4v3lmc",
    "k=lm3h,v=lm2h,group=64,residual=8,sinks=4",
    "k=lm4h,v=lm2h,group=16,residual=3,sinks=2",
    "k=lm3hb,v=lm2hb,group=32,residual=3,sinks=2,center=1",  # one-byte log scales
    "k=int2c,v=int4,group=16,residual=5,sinks=3,center=1",
    "k=int2h,v=int8,group=8,residual=0",
    "k=int4c,v=int2h,residual=4,rope=pre",
    "k=lm3h,v=lm2h,group=16,residual=3,sinks=2,center=1,layers=lm3h/lm2h;lm4hb/lm2h;lm3h/int4",  # 4 groups
    "k=lm4f4:0178.2356,v=lm2hb,vgroup=64,residual=3,sinks=2,center=1",  # frequency blocks, widths 0-8
    "k=lm3f2:15.33,v=int2h,group=32,residual=32",  # ... two blocks a row, 32 tokens waiting
    # an age tier (kv/store.py): residual -> tier -> body, the tier's rows decoded and coded again
    "k=lm3hb,v=lm2hb,group=32,residual=3,sinks=2,center=1,tier=12:lm4hb",
    "k=int4c,v=int2,group=16,residual=3,tier=5:int4",  # KIVI keys, an affine tier: the PyTorch write
    "k=lm3h,v=lm2h,group=16,residual=0,center=1,layers=lm3h/lm2h;lm4hb/lm2h;lm3h/lm3hb,tier=6:lm4h",
    "k=lm3f2:15.33,v=lm2hb,group=32,residual=3,sinks=2,center=1,tier=7:lm4hb",  # block keys beside a tier
    "k=lm3hb,v=vq2hs,group=16,residual=3,sinks=2,center=1",  # sign-structured vector codes, a byte per 4
    "k=lm3hb,v=vq2hs,group=64,residual=3,center=1,tier=7:lm4hb",  # ... beside a tier
]


def assert_same_bytes(fast: KVCache, slow: KVCache) -> None:
    assert fast.held == slow.held and fast.position == slow.position
    assert (fast.bytes.total_written, fast.bytes.total_read) == (slow.bytes.total_written, slow.bytes.total_read)
    for pair_fast, pair_slow in zip(fast.layers, slow.layers):
        for a, b in zip(pair_fast, pair_slow):
            assert a.n_body == b.n_body
            rings = [(a.sinks, b.sinks), (a.residual, b.residual), *((a.body[k], b.body[k]) for k in a.body)]
            rings += [(a.tier[k], b.tier[k]) for k in a.tier]
            for ra, rb in rings:
                assert (ra.start, ra.count) == (rb.start, rb.count)
                assert torch.equal(ra.read().view(torch.uint8), rb.read().view(torch.uint8))
            assert (a.center is None) == (b.center is None) and (a.center is None or torch.equal(a.center, b.center))


def kernels_and_reference(spec: str, dtype, capacity: int, seed: int, target: str = "native", head_dim: int = 64):
    """Two caches of 3 layers, 2 KV heads, batch 2, and feed(n): n new tokens of random keys (a few
    large channels, like real keys) and values, appended to one on the kernels backend (built for
    `target`) and to the other on the reference backend."""
    d = head_dim
    caches = [KVCache(parse_kv(spec), n_layers=3, n_kv_heads=2, head_dim=d, capacity=capacity, batch=2) for _ in "kr"]
    g = torch.Generator().manual_seed(seed)
    big = torch.zeros(d)
    big[::9] = 6.0

    token_writes = CacheWrites(caches[0])

    def feed(n: int) -> None:
        kv = [
            (
                torch.randn(2, 2, n, d, generator=g).mul(2).add(big).to(dtype),
                torch.randn(2, 2, n, d, generator=g).to(dtype),
            )
            for _ in range(3)
        ]
        with backend.using("kernels", target):
            lib = backend.library()
            k, v = torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])  # (L, B, H, n, D)
            if lib is None or n > 1 or not token_writes.append(lib, k, v):  # a decode token: one native call
                caches[0].append(kv, writer())
        caches[1].append(kv)  # the PyTorch reference

    return caches, feed


@needs_kernels
@pytest.mark.parametrize("spec", WRITE_SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_token_write_is_byte_identical_to_pytorch(spec, dtype, monkeypatch):
    """A decode step writes its token with one native call for every group of layers that share
    codecs (native/encode.cpp: write_tokens), deciding from the counters what
    ``LayeredStore.append`` decides from the tensors. Token by token from an empty cache -- sinks
    filling, the residual wrapping, KIVI groups and per-token units leaving it -- then, after
    evictions moved the body's start, a truncation and more tokens into the wrapped body rings:
    the same bytes as the reference."""
    from minillama.native import ops

    calls = []
    real = ops.write_tokens
    monkeypatch.setattr(ops, "write_tokens", lambda lib, ws: calls.append(len(ws)) or real(lib, ws))
    caches, feed = kernels_and_reference(spec, dtype, capacity=120, seed=2)
    for _ in range(70):
        feed(1)
    feed(80)  # past the capacity: evictions move every ring's start
    for cache in caches:
        cache.truncate(cache.position - 40)
    for _ in range(30):
        feed(1)
    assert_same_bytes(*caches)
    assert caches[0].evicted > 0
    if "tier" not in spec:
        assert len(calls) >= 99 and set(calls) == {len(caches[0].stores)}  # one call a token, every group in it
    if "tier" in spec and ":lm" in spec:  # one call a token; a group with a codebook tier writes once or twice in it
        assert len(calls) >= 99 and min(calls) >= len(caches[0].stores)


@pytest.mark.parametrize("spec", WRITE_SPECS)
def test_a_kernel_read_counts_what_every_store_holds(spec):
    """The native step reads every held part of every layer in place; the cache counts that from
    its rings' cursors (``count_full_read``), which must be each store's ``live_read_bytes``
    summed -- sinks, body, tier, residual and the key center -- at every fill."""
    cache = KVCache(parse_kv(spec), n_layers=3, n_kv_heads=2, head_dim=64, capacity=120)
    for n in (1, 5, 40, 90):  # sinks filling, the residual, units leaving it, past the capacity
        cache.append_stacked(*torch.randn(2, 3, 1, 2, n, 64))  # keys, values (L, B, H, n, D)
        before = cache.bytes.total_read
        cache.count_full_read()
        expected = sum(store.live_read_bytes() for pair in cache.layers for store in pair)
        assert cache.bytes.total_read - before == expected > 0, (spec, n)


@pytest.mark.parametrize("name", ["reference", "kernels"])
def test_a_non_finite_value_is_refused_before_anything_is_written(name):
    """A NaN in one layer's values, on either backend: a clear error, and the cache as it was --
    no group of layers (here the keys) a token ahead of the others."""
    from minillama.kv.quantize import NonFiniteError

    with backend.using(name):
        cache = KVCache(
            parse_kv("k=lm3h,v=int2h,group=16,residual=3"), n_layers=2, n_kv_heads=2, head_dim=64, capacity=64
        )
        fill_synthetic(cache, 20)
        before = [r.buf.clone() for s in cache.stores for r in (s.sinks, s.residual, *s.body.values())]
        for n in (1, 5):  # a decode token, a prefill chunk
            k, v = torch.randn(2, 1, 2, n, 64), torch.randn(2, 1, 2, n, 64)  # (L, B, H, n, D)
            v[1, 0, 1, 0, 7] = float("nan")
            with pytest.raises(NonFiniteError, match="non-finite keys/values"):
                cache.append_stacked(k, v)
    after = [r.buf for s in cache.stores for r in (s.sinks, s.residual, *s.body.values())]
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and cache.position == 20


@needs_kernels
def test_a_decode_tokens_write_is_all_or_nothing():
    """write_tokens checks every group's new rows before it stores any: a value that is not finite
    in one group (here the values) leaves the others (the keys) untouched too."""
    from minillama.native import ops
    from minillama.native.abi import NotSupported

    cache = KVCache(parse_kv("k=lm3h,v=int2h,group=16,residual=3"), n_layers=2, n_kv_heads=2, head_dim=64, capacity=64)
    fill_synthetic(cache, 20)
    k, v = torch.randn(2, 1, 2, 1, 64), torch.randn(2, 1, 2, 1, 64)  # (L, B, H, 1, D)
    v[1, 0, 1, 0, 7] = float("nan")
    before = [r.buf.clone() for s in cache.stores for r in (s.residual, *s.body.values())]
    with pytest.raises(NotSupported, match="not finite"):
        writes = CacheWrites(cache)  # alive while the kernel reads what its structs point at
        ops.write_tokens(backend.library(), writes.describe(k, v).array)
    after = [r.buf for s in cache.stores for r in (s.residual, *s.body.values())]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@needs_kernels
@pytest.mark.parametrize("spec", WRITE_SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpp_cache_write_is_byte_identical_to_pytorch(spec, dtype):
    """The kernels backend writes through native/encode.cpp, the reference through PyTorch: the
    rings must hold the same bytes after appends of every size, wrap-around included."""
    caches, feed = kernels_and_reference(spec, dtype, capacity=150, seed=1)
    for n in (17, 1, 1, 40, 3, 64, 1, 90, 1):
        feed(n)
    assert caches[0].evicted > 0
    assert_same_bytes(*caches)


@needs_kernels
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("head_dim", [80, 96])
def test_every_preset_writes_the_reference_bytes_at_head_sizes_80_and_96(preset, head_dim):
    """Heads that are not a power of two: groups fitted to the head (KVSpec.fitted), rotations in
    power-of-two blocks. Prefill chunks and decode tokens, through a wrap: the kernels' bytes."""
    caches, feed = kernels_and_reference(preset, torch.float32, capacity=150, seed=3, head_dim=head_dim)
    before = backend.tally()
    for n in (17, 1, 1, 40, 3, 64, 1, 90, 1):
        feed(n)
    assert_same_bytes(*caches)
    assert not [why for why in backend.tally() - before if why.startswith("fallback")]  # the kernels wrote


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("spec", ["hadv2", "k=int4h,v=int2h,group=64,residual=32,sinks=4,center=1"])
@pytest.mark.parametrize("head_dim", [64, 80, 96])
def test_every_build_target_rotates_rows_as_pytorch_does(target, spec, head_dim):
    """native/hadamard.h runs the Walsh-Hadamard passes on AVX-512 or AVX2 registers where a build
    has them, and must add and subtract exactly as the scalar passes and kv/quantize.py do: every
    build target this CPU runs writes the rotated codecs' bytes the reference writes, for heads
    rotated in one block (64) and in two (80 = 64 + 16, 96 = 64 + 32)."""
    library, why = build(target)
    if library is None:
        pytest.skip(f"no {target} build on this CPU: {why}")
    caches, feed = kernels_and_reference(spec, torch.float32, capacity=150, seed=2, target=target, head_dim=head_dim)
    for n in (17, 1, 1, 40, 3):
        feed(n)
    assert_same_bytes(*caches)


@needs_kernels
def test_the_cpp_cache_write_is_the_one_that_runs(monkeypatch):
    from minillama.kv.codecs import Affine, Codebook, Codec

    def no_pytorch_encode(*args, **kwargs):
        raise AssertionError("the PyTorch encode ran")

    monkeypatch.setattr(Affine, "encode", no_pytorch_encode)  # hadv2's key and value codecs are affine
    monkeypatch.setattr(Codec, "to_space", no_pytorch_encode)
    before = backend.tally()
    cache = KVCache(parse_kv("hadv2"), n_layers=2, n_kv_heads=2, head_dim=64, capacity=200)
    fill_synthetic(cache, 130, writer=writer())  # flushes KIVI key groups and per-token rotated values
    assert cache.layers[0][0].n_body == 96 and cache.layers[0][1].n_body == 98
    monkeypatch.setattr(Codebook, "encode", no_pytorch_encode)  # Lloyd-Max codebooks
    cache = KVCache(
        parse_kv("k=lm3h,v=lm2h,group=64,residual=8,sinks=4"), n_layers=2, n_kv_heads=2, head_dim=64, capacity=200
    )
    fill_synthetic(cache, 130, writer=writer())  # a prefill-sized block, then token by token
    for _ in range(5):
        cache.append([(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64)) for _ in range(2)], writer())
    assert cache.layers[0][0].n_body == 135 - 4 - 8
    ran = backend.tally() - before
    assert ran["cache encode"] >= 7 and ran["storage form"] >= 8 and not [k for k in ran if k.startswith("fallback")]


def test_a_codec_that_encodes_its_own_way_is_not_written_by_the_kernels():
    """native/encode.cpp writes a codec only where its class encodes as the built-in affine or
    Lloyd-Max family does: a subclass with its own ``encode`` keeps it."""
    from dataclasses import dataclass

    from minillama.kv.codecs import CODECS, Codebook
    from minillama.native.write import native_encoding

    @dataclass(frozen=True)
    class Clipped(Codebook):
        def encode(self, x, group):
            return super().encode(x.clamp(-1, 1), group)

    assert native_encoding(CODECS["int4c"]).__name__ == "Affine"
    assert native_encoding(CODECS["lm3h"]) is Codebook
    assert native_encoding(Clipped("lm3clip", 3, "clipped", rotate=True)) is None


@needs_kernels
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("group", [16, 64])
@pytest.mark.parametrize("log_scale", [False, True])
@pytest.mark.parametrize("refine", [1, 4, 10])
def test_the_cpp_codebook_encoder_writes_the_reference_bytes(bits, group, log_scale, refine):
    """native/encode.cpp's Lloyd-Max encoder against kv/quantize.py's (codes packed as the cache
    packs them, at the presets' widths and the frequency blocks' 1-8; fp16 scales, or one-byte
    log scales), on groups of every scale from tiny (off
    the log grid's low end) to wide-ranging: the scale's refinement sums in double, so the
    order of the additions must not move a byte. The C++ encoder stops refining a group once a
    round repeats the codes of the round before (the reference runs every round): with 1, the
    presets' 4 and 10 rounds the bytes are the same."""
    from minillama.kv import packing
    from minillama.kv.quantize import gaussian_codebook, quantize_codebook
    from minillama.native import ops

    g = torch.Generator().manual_seed(bits * group)
    x = torch.randn(4, 8, 256, 64, generator=g)  # (B, H, T, D)
    x = x * torch.rand(4, 8, 256, 1, generator=g).mul(4) * torch.rand(4, 8, 256, 64, generator=g).pow(6).mul(30)
    x[0] *= 1e-4  # groups near float16's smallest normals
    x[1, 0, :3] = 0.0  # all-zero groups: the smallest scale, in both encoders
    x = x.to(torch.float16)
    codes, scale = quantize_codebook(x, bits, group, refine, log_scale=log_scale)
    native = ops.encode_codebook(backend.library(), x, bits, group, gaussian_codebook(bits), refine, log_scale)
    assert native["scale"].dtype == scale.dtype == (torch.uint8 if log_scale else torch.float16)
    assert torch.equal(native["scale"].view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(native["codes"], packing.pack(codes, bits))


@needs_kernels
@pytest.mark.parametrize("group", [16, 64])
@pytest.mark.parametrize("refine", [1, 4, 10])
@pytest.mark.parametrize("d", [64, 128])
def test_the_cpp_vector_encoder_writes_the_reference_bytes(group, refine, d):
    """native/encode.cpp's sign-structured vector encoder (vq2hs: a byte per 4 channels) against
    kv/quantize.py's quantize_vectors, on groups of every scale: the nearest pattern is searched
    in float64 with the sums in one order on both sides, so every code and scale is the same."""
    from minillama.kv.quantize import quantize_vectors, vector_patterns
    from minillama.native import ops

    g = torch.Generator().manual_seed(group + refine + d)
    x = torch.randn(4, 8, 256, d, generator=g)  # (B, H, T, D)
    x = x * torch.rand(4, 8, 256, 1, generator=g).mul(4) * torch.rand(4, 8, 256, d, generator=g).pow(6).mul(30)
    x[0] *= 1e-4  # groups near float16's smallest normals
    x[1, 0, :3] = 0.0  # all-zero groups: the smallest scale, in both encoders
    x = x.to(torch.float16)
    codes, scale = quantize_vectors(x, 4, 2, group, refine)
    native = ops.encode_vectors(backend.library(), x, 2, group, 4, vector_patterns(4, 2), refine)
    assert torch.equal(native["codes"], codes.to(torch.uint8))
    assert torch.equal(native["scale"].view(torch.int16), scale.view(torch.int16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize(
    "spec",
    list(PRESETS)
    + [
        "k=int2c,v=int4h,residual=4,sinks=2",
        "k=int4c,v=lm2h,rope=pre",
        "k=lm3f2:24.15,v=lm2hb,vgroup=64,residual=8,sinks=2",
    ],
)
def test_the_reference_path_runs_every_codec_on_cuda(tiny_dir, spec):
    """The reference path is device-agnostic: a CUDA cache gives the CPU cache's logits (float32)."""
    t = tokens(40)
    logits = []
    for device in ("cpu", "cuda"):
        lm = load_model(str(tiny_dir), "float32", device)
        cache = KVCache.for_model(lm.config, parse_kv(spec), 128, device=device)  # room for sinks + residual + a group
        logits.append(run(lm.model, cache, t.to(device)).cpu())
    assert torch.allclose(logits[0], logits[1], atol=1e-3)


def vm_flags(address: int) -> list[str]:
    """The flags of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return []


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="no /proc/self/smaps (not Linux)")
def test_a_large_ring_buffer_is_zeros_that_asked_for_huge_pages():
    """Decode attention streams the whole cache every step; rings of 4 MB and more ask the kernel
    for transparent huge pages before first touch (the mapping carries the `hg` flag), so a
    layer's rows are a few TLB entries rather than thousands. Small ones are plain zeros."""
    big = ring_buffer((2, 1, 3, 8192, 64), torch.float16, "cpu")  # 6 MB
    assert big.shape == (2, 1, 3, 8192, 64) and big.dtype == torch.float16 and not big.any()
    inside = big.data_ptr() - big.data_ptr() % HUGE_PAGE + HUGE_PAGE  # an aligned page of the buffer
    assert "hg" in vm_flags(inside)
    small = ring_buffer((1, 1, 4, 8), torch.uint8, "cpu")
    assert small.shape == (1, 1, 4, 8) and not small.any()
