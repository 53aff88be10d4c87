"""The fused decode attention (C++ kernels on packed codes) equals the reference path.

Every kernel test runs on each build this CPU can run (native/build.py: ``native`` with
everything the CPU has, ``avx2``, ``portable``), so the AVX2 and plain-C paths are tested on
an AVX-512 machine too; targets the CPU cannot run are skipped with the reason.
"""

from __future__ import annotations

import pytest
import torch

from minillama.eval.synthetic import fill_synthetic
from minillama.kv.cache import KVCache
from minillama.kv.codecs import CODECS
from minillama.kv.spec import PRESETS, parse_kv
from minillama.model.attention import attend
from minillama.native import backend, ops
from minillama.native.plans import fused_decode_attention


def reference_attention(q, k, v, cache, layer=0):
    view = cache.layer(layer)
    return attend(q, k, v, view.read(torch.float32), view.k_codec, view.v_codec, view.key_center)


SPECS = (
    list(PRESETS)
    + [f"k={c},v={c},group=16,residual=5" for c in CODECS]
    + [
        "k=int4c,v=int2h,group=32,residual=32,sinks=4",
        "k=int3h,v=tern,group=32,residual=0,sinks=2",
        "k=lm3h,v=lm2h,group=64,residual=8,sinks=4,center=1",
        "k=int4c,v=int4,group=32,residual=32,center=1",
        "k=int4c,v=int2h,kgroup=16,vgroup=64,residual=8,sinks=4",
        "k=int2c,v=int3h,vgroup=64,residual=8,sinks=4,start=50",
        "k=int2c,v=int2h,kgroup=16,residual=8,sinks=4",
    ]
)


def compare(lib, spec: str, batch: int, tokens: int, capacity: int = 512, chunk: int = 7):
    cache = KVCache(parse_kv(spec), n_layers=1, n_kv_heads=2, head_dim=64, capacity=capacity, batch=batch)
    fill_synthetic(cache, tokens, chunk=chunk)
    g = torch.Generator().manual_seed(tokens)
    q = torch.randn(batch, 6, 1, 64, generator=g)  # 3 query heads per KV head
    k, v = torch.randn(batch, 2, 1, 64, generator=g), torch.randn(batch, 2, 1, 64, generator=g)
    reference = reference_attention(q, k, v, cache)
    fused = fused_decode_attention(lib, q, k, v, cache.layer(0))
    return reference, fused, cache


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("batch", [1, 3])
def test_fused_equals_reference_for_every_codec(lib, spec, batch):
    for tokens in (1, 45, 77):  # not multiples of the group; 1 = only the residual or sinks
        reference, fused, _ = compare(lib, spec, batch, tokens)
        assert torch.allclose(fused, reference, atol=2e-5, rtol=1e-4), (spec, tokens)


@pytest.mark.parametrize("spec", ["fp16", "kivi4", "hadv2", "k=int4c,v=int2h,group=8,residual=8,sinks=4", "ternary"])
def test_fused_equals_reference_after_the_ring_wraps(lib, spec):
    reference, fused, cache = compare(lib, spec, 2, 700, capacity=200, chunk=3)
    assert cache.evicted > 0
    assert torch.allclose(fused, reference, atol=2e-5, rtol=1e-4)


def test_the_native_step_counts_the_bytes_a_reference_step_reads(lib, tiny):
    """The native step reads the packed cache in place; the cache counts those bytes as the
    reference's read of the dequantized copy counts them."""
    t = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    read = {}
    for name in ("reference", "kernels"):
        with backend.using(name), torch.inference_mode():
            cache = KVCache.for_model(tiny.config, parse_kv("hadv2"), 64)
            tiny.model(t[:, :30], cache)
            before = backend.tally()
            tiny.model(t[:, 30:31], cache)
            ran = backend.tally() - before
            read[name] = cache.bytes.last_read
    assert ran["decode step"] == 1 and read["kernels"] == read["reference"] > 0


def test_model_decode_with_the_kernels_matches_the_reference_backend(lib, tiny):
    t = torch.randint(0, 300, (2, 60), generator=torch.Generator().manual_seed(0))

    def run():
        cache = KVCache.for_model(tiny.config, parse_kv("k=int4c,v=int2h,residual=8,sinks=2"), 64, batch=2)
        with torch.inference_mode():
            tiny.model(t[:, :20], cache)
            return torch.cat([tiny.model(t[:, i : i + 1], cache) for i in range(20, 60)], dim=1)

    with backend.using("reference"):
        reference = run()
    before = backend.tally()
    kernels = run()  # the fixture's kernels-exact backend
    assert (backend.tally() - before)["decode step"] == 40
    assert torch.allclose(kernels, reference, atol=1e-4)


def test_the_reference_backend_runs_without_any_kernel(tiny, monkeypatch):
    def no_kernels(*args, **kwargs):
        raise AssertionError("a kernel was built or loaded under the reference backend")

    monkeypatch.setattr(backend, "_load", no_kernels)
    with backend.using("reference"):
        cache = KVCache.for_model(tiny.config, parse_kv("hadv2"), 64)
        tiny.model(torch.tensor([[1, 2, 3]]), cache)
        assert torch.isfinite(tiny.model(torch.tensor([[4]]), cache)).all()


def test_a_cpu_without_the_kernels_says_so_in_one_line_and_runs_the_reference(tiny_dir, monkeypatch):
    """No C++ compiler (or a failed build): the command still works, on the PyTorch reference, and
    says once on stderr why it is slower; --backend reference asked for that and says nothing."""
    from click.testing import CliRunner

    from minillama.app.cli import cli

    monkeypatch.setattr(backend, "_load", lambda target: (None, "no C++ compiler found (install g++)"))
    args = ["generate", "hello", "--model", str(tiny_dir), "--max-tokens", "3"]
    with backend.using("kernels"):  # restores the backend --backend sets for the rest of the session
        result = CliRunner().invoke(cli, args)
        quiet = CliRunner().invoke(cli, [*args, "--backend", "reference"])
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if line.startswith("note: the compiled kernels")]
    assert len(notes) == 1 and "install g++" in notes[0] and "PyTorch reference" in notes[0]
    assert quiet.exit_code == 0 and "compiled kernels" not in quiet.stderr


@pytest.mark.parametrize("head_dim,q_per_kv", [(32, 3), (64, 1), (64, 2), (128, 1), (128, 4), (128, 2)])
@pytest.mark.parametrize("spec", ["fp16", "kivi4", "hadv2", "k=lm3h,v=lm2h,group=32,residual=4,sinks=2"])
def test_fused_equals_reference_for_other_head_shapes(lib, head_dim, q_per_kv, spec):
    """The kernel has compile-time versions for common (head_dim, query heads per KV head) and a generic one."""
    cache = KVCache(parse_kv(spec), n_layers=1, n_kv_heads=2, head_dim=head_dim, capacity=256)
    fill_synthetic(cache, 99, chunk=5)
    q = torch.randn(1, 2 * q_per_kv, 1, head_dim)
    k, v = torch.randn(1, 2, 1, head_dim), torch.randn(1, 2, 1, head_dim)
    reference = reference_attention(q, k, v, cache)
    assert torch.allclose(fused_decode_attention(lib, q, k, v, cache.layer(0)), reference, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("n_out,n_in", [(7, 576), (576, 1536), (1029, 100), (64, 4096), (5, 3)])
@pytest.mark.parametrize("rows", [1, 3, 4, 16, 21])  # 21: past 16 rows the kernel takes them 16 at a time
def test_bf16_skinny_product_kernel_equals_float_math(lib, n_out, n_in, rows):
    """The native step's projections and LM head (native/linear.cpp): y = x W^T with bf16 weights,
    accumulated in float32, before the one rounding F.linear makes."""
    w = torch.randn(n_out, n_in).to(torch.bfloat16)
    x = torch.randn(rows, n_in).to(torch.bfloat16)
    fast = ops.gemm_rows(lib, x, w)  # (rows, n_out) float32
    reference = torch.nn.functional.linear(x.float(), w.float())
    assert fast.shape == (rows, n_out) and fast.dtype == torch.float32
    assert torch.allclose(fast, reference, rtol=1e-5, atol=1e-5 * n_in**0.5)  # float sums in another order
    torch_bf16 = torch.nn.functional.linear(x, w)  # torch's own bf16 product, rounded once
    assert torch.allclose(fast.to(torch.bfloat16).float(), torch_bf16.float(), rtol=2**-6, atol=2e-3)


@pytest.mark.parametrize("n_out,n_in", [(7, 576), (1029, 100), (5, 3)])
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 37])
def test_float32_skinny_product_kernel_equals_f_linear(lib, n_out, n_in, rows):
    """The same kernel with float32 weights (perplexity runs W windows in float32)."""
    w, x = torch.randn(n_out, n_in), torch.randn(rows, n_in)
    fast = ops.gemm_rows(lib, x, w)
    reference = torch.nn.functional.linear(x, w)
    # float32 sums of n_in products in another order: within a few ulps of the sum's magnitude
    assert torch.allclose(fast, reference, rtol=1e-5, atol=1e-5 * n_in**0.5)
