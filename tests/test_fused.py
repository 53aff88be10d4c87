"""The fused decode attention (C++ kernel on packed codes) equals the reference path."""

from __future__ import annotations

import platform

import pytest
import torch

from minillama.kv import kernels
from minillama.model.attention import attend
from minillama.kv.budget import fill_synthetic
from minillama.kv.cache import KVCache
from minillama.kv.codecs import CODECS
from minillama.kv.spec import PRESETS, parse_kv
from minillama.kv.fused_attention import fused_decode_attention

needs_kernel = pytest.mark.skipif(kernels.load() is None, reason="no C++ compiler: the reference path is used")


@pytest.fixture(autouse=True)
def exact_kernels(monkeypatch):
    """These tests hold the exact float kernels to the reference; the integer-domain ones, which are
    approximate by design, are held to their bound in test_integer_attention.py."""
    monkeypatch.setenv("MINILLAMA_EXACT_ATTENTION", "1")

SPECS = list(PRESETS) + [f"k={c},v={c},group=16,residual=5" for c in CODECS] + [
    "k=int4c,v=int2h,group=32,residual=32,sinks=4", "k=int3h,v=ternh,group=32,residual=0,sinks=2",
    "k=lm3h,v=lm2h,group=64,residual=8,sinks=4,center=1", "k=int4c,v=int4,group=32,residual=32,center=1",
    "k=int4c,v=int2h,kgroup=16,vgroup=64,residual=8,sinks=4", "k=nuq3,v=int3h,vgroup=64,residual=8,sinks=4,start=50",
    "k=int3c,v=int2h,kgroup=16,residual=8,sinks=4,kfirst=int4c,first=1"]


def compare(spec: str, batch: int, tokens: int, capacity: int = 512, chunk: int = 7):
    cache = KVCache(parse_kv(spec), n_layers=1, n_kv_heads=2, head_dim=64, capacity=capacity, batch=batch)
    fill_synthetic(cache, tokens, chunk=chunk)
    g = torch.Generator().manual_seed(tokens)
    q = torch.randn(batch, 6, 1, 64, generator=g)  # 3 query heads per KV head
    k, v = torch.randn(batch, 2, 1, 64, generator=g), torch.randn(batch, 2, 1, 64, generator=g)
    reference = attend(q, k, v, cache.read(0, torch.float32), *cache.codecs(0), cache.key_center(0))
    fused = fused_decode_attention(q, k, v, cache, 0)
    return reference, fused, cache


@needs_kernel
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("batch", [1, 3])
def test_fused_equals_reference_for_every_codec(spec, batch):
    for tokens in (1, 45, 77):  # not multiples of the group; 1 = only the residual or sinks
        reference, fused, _ = compare(spec, batch, tokens)
        assert torch.allclose(fused, reference, atol=2e-5, rtol=1e-4), (spec, tokens)


@needs_kernel
@pytest.mark.parametrize("spec", ["fp16", "kivi4", "hadv2", "k=int4c,v=int2h,group=8,residual=8,sinks=4", "ternary"])
def test_fused_equals_reference_after_the_ring_wraps(spec):
    reference, fused, cache = compare(spec, 2, 700, capacity=200, chunk=3)
    assert cache.evicted > 0
    assert torch.allclose(fused, reference, atol=2e-5, rtol=1e-4)


@needs_kernel
def test_fused_counts_the_same_bytes_as_the_reference():
    cache = KVCache(parse_kv("hadv2"), 1, 2, 64, 256)
    fill_synthetic(cache, 100)
    q, k, v = torch.randn(1, 6, 1, 64), torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64)
    cache.read(0, torch.float32)
    by_reference = cache._pending_read
    fused_decode_attention(q, k, v, cache, 0)
    assert cache._pending_read == 2 * by_reference


@needs_kernel
def test_model_decode_with_fused_path_matches_reference_path(tiny):
    t = torch.randint(0, 300, (2, 60), generator=torch.Generator().manual_seed(0))
    outs = []
    for fused in (False, True):
        cache = KVCache.for_model(tiny.config, parse_kv("k=int4c,v=int2h,residual=8,sinks=2"), 64, batch=2, fused=fused)
        tiny.model(t[:, :20], cache)
        outs.append(torch.cat([tiny.model(t[:, i : i + 1], cache) for i in range(20, 60)], dim=1))
    assert torch.allclose(outs[0], outs[1], atol=1e-4)


def test_reference_fallback_when_the_kernel_is_disabled(tiny, monkeypatch):
    monkeypatch.setenv("MINILLAMA_KERNEL", "0")
    kernels.load.cache_clear()
    try:
        assert kernels.load() is None
        cache = KVCache.for_model(tiny.config, parse_kv("hadv2"), 64)
        tiny.model(torch.tensor([[1, 2, 3]]), cache)
        assert torch.isfinite(tiny.model(torch.tensor([[4]]), cache)).all()
    finally:
        monkeypatch.delenv("MINILLAMA_KERNEL")
        kernels.load.cache_clear()


@needs_kernel
@pytest.mark.parametrize("head_dim,q_per_kv", [(32, 3), (64, 1), (64, 2), (128, 1), (128, 4), (128, 2)])
@pytest.mark.parametrize("spec", ["fp16", "kivi4", "hadv2", "k=lm3h,v=lm2h,group=32,residual=4,sinks=2"])
def test_fused_equals_reference_for_other_head_shapes(head_dim, q_per_kv, spec):
    """The kernel has compile-time versions for common (head_dim, query heads per KV head) and a generic one."""
    cache = KVCache(parse_kv(spec), n_layers=1, n_kv_heads=2, head_dim=head_dim, capacity=256)
    fill_synthetic(cache, 99, chunk=5)
    q = torch.randn(1, 2 * q_per_kv, 1, head_dim)
    k, v = torch.randn(1, 2, 1, head_dim), torch.randn(1, 2, 1, head_dim)
    reference = attend(q, k, v, cache.read(0, torch.float32), *cache.codecs(0), cache.key_center(0))
    assert torch.allclose(fused_decode_attention(q, k, v, cache, 0), reference, atol=2e-5, rtol=1e-4)


@needs_kernel
@pytest.mark.parametrize("n_out,n_in", [(7, 576), (576, 1536), (1029, 100), (64, 4096), (5, 3)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_bf16_skinny_product_kernel_equals_float_math(n_out, n_in, bias, rows):
    """DecodeLinear's kernel path: y = x W^T (+ b) with bf16 weights, accumulated in float32."""
    from minillama.model.linear import DecodeLinear

    layer = DecodeLinear(n_in, n_out, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 1, n_in).to(torch.bfloat16)
    with torch.no_grad():
        fast = layer(x)  # a few rows, bf16 weights: the kernel
        layer.kernel = False
        reference = torch.nn.functional.linear(x.float(), layer.weight.float(),
                                               None if layer.bias is None else layer.bias.float())
        torch_bf16 = layer(x)
    assert fast.shape == (rows, 1, n_out) and fast.dtype == torch.bfloat16
    # Both round the float32 result to bf16 once: within one bf16 ulp of exact float math.
    assert torch.allclose(fast.float(), reference, rtol=2 ** -7, atol=1e-3)
    assert torch.allclose(fast.float(), torch_bf16.float(), rtol=2 ** -6, atol=2e-3)


@needs_kernel
@pytest.mark.parametrize("n_out,n_in", [(7, 576), (1029, 100), (5, 3)])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_float32_skinny_product_kernel_equals_f_linear(n_out, n_in, rows):
    """The same kernel with float32 weights (perplexity runs W windows in float32)."""
    from minillama.model.linear import DecodeLinear

    layer = DecodeLinear(n_in, n_out, bias=True)
    x = torch.randn(rows, 1, n_in)
    with torch.no_grad():
        fast = layer(x)
        layer.kernel = False
        reference = layer(x)
    # float32 sums of n_in products in another order: within a few ulps of the sum's magnitude
    assert torch.allclose(fast, reference, rtol=1e-5, atol=1e-5 * n_in ** 0.5)


@needs_kernel
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="baseline build is x86-64 specific")
@pytest.mark.parametrize("spec", ["fp16", "kivi4", "hadv2", "k4v3hc", "k4v3lmc", "k=lm2h,v=int8,group=16,residual=3"])
def test_portable_build_without_avx512_equals_reference(spec, monkeypatch):
    """The kernels compiled for a baseline x86-64 CPU (lookup-table unpacking, no AVX-512)
    must match the reference too: that is the code other machines run."""
    from minillama.kv import fused_attention

    portable = kernels.build(kernels.PORTABLE_FLAGS)
    assert portable is not None
    monkeypatch.setattr(fused_attention, "load", lambda: portable)
    reference, fused, _ = compare(spec, 2, 77)
    assert torch.allclose(fused, reference, atol=2e-5, rtol=1e-4)
