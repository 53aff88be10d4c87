"""Keys stored before RoPE (rope=pre) and positions that survive eviction (positions=cache)."""

from __future__ import annotations

import pytest
import torch

from minillama.eval.synthetic import fill_synthetic
from minillama.kv.cache import KVCache
from minillama.kv.spec import parse_kv
from minillama.model.attention import PLAIN, attend, plain_keys
from minillama.model.rope import RotaryTable, apply_rope, rope_tables
from minillama.native import backend
from minillama.native.plans import fused_decode_attention
from tests.fakes import ListCache

needs_kernels = pytest.mark.skipif(backend.library() is None, reason="the kernels did not build here")
BACKENDS = ["reference", "kernels-exact"]  # exactness tests: the integer-domain kernels have their own bound tests


@torch.inference_mode()  # as generation runs: the native decode step runs only without autograd
def run(model, cache, tokens, chunks=(5, 3)):
    """Prefill in chunks, then decode token by token; all logits (B, T, V)."""
    outs, i = [], 0
    for c in chunks:
        outs.append(model(tokens[:, i : i + c], cache))
        i += c
    outs += [model(tokens[:, j : j + 1], cache) for j in range(i, tokens.shape[1])]
    return torch.cat(outs, dim=1)


def tokens(n, seed=0, batch=1):
    return torch.randint(0, 300, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("capacity", [64, 30])  # 30: the ring wraps and evicts
def test_pre_rope_with_exact_storage_gives_the_same_logits_as_post(tiny, name, capacity):
    t = tokens(50, batch=2)
    with backend.using(name):
        post = run(tiny.model, KVCache.for_model(tiny.config, parse_kv("k=fp32,v=fp32,sinks=2"), capacity, batch=2), t)
        cache = KVCache.for_model(tiny.config, parse_kv("k=fp32,v=fp32,sinks=2,rope=pre"), capacity, batch=2)
        pre = run(tiny.model, cache, t)
    assert torch.allclose(pre, post, atol=1e-5, rtol=1e-5)
    assert (cache.evicted > 0) == (capacity < 50)


@pytest.mark.parametrize("name", BACKENDS)
def test_cache_positions_equal_a_cache_rebuilt_at_slots_0_to_c(tiny, name):
    t = tokens(70)
    cfg = tiny.config
    ours = KVCache.for_model(cfg, parse_kv("k=fp32,v=fp32,sinks=4,rope=pre,positions=cache"), 24)
    by_hand = ListCache(cfg.num_hidden_layers, cfg.n_kv_heads, cfg.head_dim, 24, 4, pre_rope=True, slot_positions=True)
    with backend.using(name):
        a, b = run(tiny.model, ours, t, chunks=(8,)), run(tiny.model, by_hand, t, chunks=(8,))
    assert ours.evicted == 70 - 24
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_cache_positions_never_pass_the_capacity(tiny):
    cache = KVCache.for_model(tiny.config, parse_kv("k=fp16,v=fp16,sinks=4,rope=pre,positions=cache"), 32)
    run(tiny.model, cache, tokens(100), chunks=(16,))
    assert cache.position == 100 and cache.next_position == 32  # the next token's position
    assert cache.layer(0).positions().tolist() == list(range(32))


def compare_fused(lib, spec, n, capacity=512, chunk=7, batch=2):
    """One decode step's attention through the fused kernels and through the reference, pre-RoPE keys."""
    cache = KVCache(parse_kv(spec), n_layers=1, n_kv_heads=2, head_dim=64, capacity=capacity, batch=batch)
    fill_synthetic(cache, n, chunk=chunk)
    cache.position += 5  # absolute positions need not start where the slots do
    g = torch.Generator().manual_seed(n)
    q, k, v = (
        torch.randn(batch, 6, 1, 64, generator=g),
        torch.randn(batch, 2, 1, 64, generator=g),
        torch.randn(batch, 2, 1, 64, generator=g),
    )
    rotary = RotaryTable(1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)))
    pos = torch.tensor([cache.next_position])
    cos, sin = rope_tables(rotary.inv_freq, pos, torch.float32)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    view = cache.layer(0)
    past_k, past_v = view.read(torch.float32)
    cos_k, sin_k = rotary.at(view.positions())
    past_k = apply_rope(plain_keys(past_k, cache.spec.k, view.key_center), cos_k, sin_k)
    reference = attend(q, k, v, (past_k, past_v), PLAIN, cache.spec.v, None)
    return reference, fused_decode_attention(lib, q, k, v, view, rotary.halves), cache


@needs_kernels
@pytest.mark.parametrize(
    "spec",
    [
        "k=fp16,v=fp16,rope=pre",
        "k=int4c,v=int2h,group=32,residual=32,sinks=4,rope=pre",
        "k=int4,v=int3h,group=16,residual=5,center=1,rope=pre",
        "k=int2c,v=int4,group=32,residual=8,sinks=4,rope=pre",
        "k=int4c,v=int2c,residual=8,sinks=4,rope=pre,positions=cache",
        "k=int4,v=int2h,residual=8,sinks=4,rope=pre,positions=cache,start=40",
    ],
)
@pytest.mark.parametrize("n, capacity", [(1, 512), (45, 512), (77, 512), (700, 200)])  # 700 into 200: wrapped
def test_fused_pre_rope_attention_equals_the_reference(spec, n, capacity):
    with backend.using("kernels-exact"):
        reference, fused, cache = compare_fused(backend.library(), spec, n, capacity)
    assert (cache.evicted > 0) == (n > capacity)
    assert torch.allclose(fused, reference, atol=3e-5, rtol=1e-4)


def test_positions_cache_needs_pre_rope_and_rotated_keys_refuse_pre_rope():
    from minillama.errors import UserError

    with pytest.raises(UserError, match="positions=cache needs rope=pre"):
        parse_kv("k=fp16,v=fp16,positions=cache")
    with pytest.raises(UserError, match="rope=pre needs an unrotated key codec"):
        KVCache(parse_kv("k=int4h,v=int4h,rope=pre"), 1, 1, 64, 128)
