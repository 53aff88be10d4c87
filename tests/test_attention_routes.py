"""Every route of the decode attention kernel against the reference, on every shape it takes.

The driver (native/layer_attention.cpp) splits the held tokens across threads in blocks and
merges their online-softmax partials; the block kernels read one part each, through the generic
code, the AVX-512 kernels (avx512_attention.cpp) or the integer ones (avx512_vnni_attention.cpp and
others). These tests hold all of them to model/attention.py for query heads per KV head
1 ... 16, head_dim 64 and 128, contexts that divide no block or group size (0 held tokens, 1,
31, 33, and 1000 through a ring of 600 that has wrapped, with sinks), batch 1 and 3, on each
build target this CPU runs.
"""

from __future__ import annotations

import functools
import math
import platform
from pathlib import Path

import pytest
import torch

from minillama.eval.synthetic import fill_synthetic
from minillama.kv.cache import KVCache
from minillama.kv.spec import parse_kv
from minillama.model.attention import attend_cache
from minillama.model.rope import RotaryTable
from minillama.native import abi, backend
from minillama.native.abi import Route
from minillama.native.build import TARGETS, build
from minillama.native.plans import fused_decode_attention, held_parts, route, row_source

# One spec per kind of part: float rows, KIVI keys with per-token values, Hadamard 2-bit values
# with sinks, centered Hadamard keys with 3-bit values, codebooks, keys before RoPE (rows decoded
# one at a time), vector codes, codebooks with one-byte scales.
SPECS = [
    "fp16",
    "kivi4",
    "hadv2,sinks=4",
    "k=int4h,v=int3h,group=64,residual=32,sinks=4,center=1",
    "k4v3lmc",
    "k=lm3h,v=lm2h,group=64,residual=8,sinks=4",
    "k=int4c,v=int2h,group=32,residual=8,sinks=4,rope=pre",
    "k=int2c,v=int3h,vgroup=64,residual=8,sinks=2",
    "k=vq2hs,v=vq2hs,kgroup=64,vgroup=16,residual=8,sinks=4",  # vector codes: rows decoded by table lookup
    "k=lm3hb,v=lm2hb,group=64,residual=8,sinks=4",  # one-byte log scales
    "k=lm4hb,v=lm3hb,kgroup=32,vgroup=16,residual=8,center=1",  # ... in narrower groups
    "k=lm4hb,v=lm2hb,kgroup=64,residual=8",  # ... one a row at head_dim 64: the integer codebook keys
    "k=lm3f2:24.15,v=lm2hb,vgroup=64,residual=8,sinks=4,center=1",  # keys in frequency blocks, per head widths
    "k=lm3f4:2244.0255,v=fp16,residual=8",  # ... four blocks, one of them dropped
    "k=lm4f2:17.08,v=fp16,residual=8",  # ... the widths 6-8 only the generic block decode reads
]
CONTEXTS = [(0, 128, 1), (1, 128, 3), (31, 128, 1), (33, 128, 3), (1000, 600, 1)]  # (tokens, capacity, batch)


@pytest.fixture(params=list(TARGETS))
def target(request):
    library, why = build(request.param)
    if library is None:
        pytest.skip(f"no {request.param} build on this CPU: {why}")
    return request.param


@functools.cache  # every target reads the same cases: filled once (filling costs more than attending)
def case(spec: str, tokens: int, capacity: int, batch: int, r: int, d: int, seed: int):
    cache = KVCache(parse_kv(spec), n_layers=1, n_kv_heads=2, head_dim=d, capacity=capacity, batch=batch)
    if tokens:
        fill_synthetic(cache, tokens, chunk=7)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 2 * r, 1, d, generator=g)
    k, v = torch.randn(batch, 2, 1, d, generator=g), torch.randn(batch, 2, 1, d, generator=g)
    rotary = (
        RotaryTable(1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))) if cache.pre_rope else None
    )
    return cache, q, k, v, rotary


def reference(cache, q, k, v, rotary):
    """model/attention.py over the cache as stored (keys before RoPE rotated for their positions)."""
    with backend.using("reference"):
        return attend_cache(q, k, v, cache.layer(0), rotary)


def kernel(lib, cache, q, k, v, rotary):
    return fused_decode_attention(lib, q, k, v, cache.layer(0), rotary.halves if rotary else None)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("r", [1, 2, 3, 4, 7, 8, 12, 16])
def test_every_route_equals_the_reference(target, r, d):
    with backend.using("kernels-exact", target):
        lib = backend.library()
        for spec in SPECS:
            for tokens, capacity, batch in CONTEXTS:
                cache, q, k, v, rotary = case(spec, tokens, capacity, batch, r, d, seed=tokens + r)
                assert (cache.evicted > 0) == (tokens > capacity)
                fused = kernel(lib, cache, q, k, v, rotary)
                assert torch.allclose(fused, reference(cache, q, k, v, rotary), atol=3e-5, rtol=1e-4), (
                    spec,
                    tokens,
                    r,
                    d,
                )


@pytest.mark.parametrize("r,d", [(3, 128), (16, 64)])  # blocks of 1024 and of 512 (16 heads)
def test_a_long_context_walks_several_blocks_a_thread(target, r, d):
    """The driver walks a thread's tokens in blocks of up to 1024 (layer_attention.cpp:
    block_size; 512 at 16 heads), carrying the online softmax's max, sum and output from block
    to block: 5000 tokens through a wrapped ring are several blocks for every thread, and each
    block kernel call covers a whole block. Exact float kernels equal the reference; the integer
    ones (kernels backend) stay within their bound."""
    specs = ("fp16", "hadv2,sinks=4", "k4v3lmc", "k=lm3hb,v=lm2hb,group=64,residual=8,sinks=4")
    with backend.using("kernels-exact", target):
        lib = backend.library()
        for spec in specs:
            cache, q, k, v, rotary = case(spec, 5000, 4700, 1, r, d, seed=r)
            fused = kernel(lib, cache, q, k, v, rotary)
            assert torch.allclose(fused, reference(cache, q, k, v, rotary), atol=3e-5, rtol=1e-4), (spec, r, d)
    with backend.using("kernels", target):
        lib = backend.library()
        for spec in specs[1:]:
            cache, q, k, v, rotary = case(spec, 5000, 4700, 1, r, d, seed=r)
            fused = kernel(lib, cache, q, k, v, rotary)
            error = (fused - reference(cache, q, k, v, rotary)).abs().max()
            assert error <= integer_bound(cache, v, d), (spec, r, d)


def integer_bound(cache, v, d: int) -> float:
    """How far the integer route's output may be from the exact one, loosely: the int8 queries'
    score error (test_integer_attention.py) as a relative weight change, on the largest value,
    plus 1% of it for the int16 value weights."""
    held = cache.layer(0).read(torch.float32)[1]
    vmax = max(held.abs().max().item() if held.numel() else 0.0, v.abs().max().item())
    return (math.exp(2 * 0.1 / math.sqrt(d)) - 1) * vmax + 0.01 * vmax


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("r", [1, 3, 8, 16])
def test_the_integer_route_stays_within_its_bound_on_every_shape(target, r, d):
    """The kernels backend's integer scores (int8 queries): each score is off by at most about
    a/2 * sum |code| (test_integer_attention.py); here the whole output, loosely (see there)."""
    with backend.using("kernels", target):
        lib = backend.library()
        for spec in (
            "kivi4",
            "hadv2,sinks=4",
            "k=int4h,v=int3h,group=64,residual=32,sinks=4,center=1",
            "k4v3lmc",
            "k=lm3hb,v=lm2hb,group=64,residual=8,sinks=4",
            "k=lm2h,v=lm2h,kgroup=64,vgroup=64,residual=8,sinks=4,center=1",  # integer 2-bit book keys at head_dim 64
            "k=lm2f2:13.22,v=lm2hb,vgroup=64,residual=8,sinks=4,center=1",  # integer frequency-block keys (VNNI, 64)
            "k=lm3f4:2244.0255,v=fp16,residual=8",  # ... a head with a 5-bit block read exactly within the route
        ):
            for tokens, capacity, batch in CONTEXTS:
                cache, q, k, v, rotary = case(spec, tokens, capacity, batch, r, d, seed=tokens + r)
                fused = kernel(lib, cache, q, k, v, rotary)
                exact = reference(cache, q, k, v, rotary)
                assert (fused - exact).abs().max() <= integer_bound(cache, v, d), (spec, tokens, r, d)
        # and the integer route is the one that ran where the build has it: hadv2's 2-bit rotated
        # values take it on every build with AVX2 and BMI2 (the AVX-512 VNNI and the AVX2 kernels)
        cache, *_ = case("hadv2", 200, 256, 1, r, d, seed=0)
        body = next(p for p in held_parts(cache.layer(0))[1] if p.name == "body")
        chosen = route(lib, True, body, row_source(body, None, None, []), r, d)
        integer = {"avx2", "bmi2"} <= set(abi.features(lib))
        assert (chosen == Route.INTEGER) == integer, (chosen, abi.features(lib))


CPU_FLAGS = {  # the build's feature -> the /proc/cpuinfo flags a CPU needs for it
    "avx2": {"avx2", "fma", "f16c"},
    "bmi2": {"bmi2"},
    "avx512": {"avx512f", "avx512bw", "avx512vl"},
    "avx512_bf16": {"avx512_bf16"},
    "avx512_vnni": {"avx512_vnni"},
    "avx512_vbmi": {"avx512vbmi"},
}


def cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text()
    return set(next(line for line in text.splitlines() if line.startswith("flags")).split(":", 1)[1].split())


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists() or platform.machine() != "x86_64", reason="x86-64 Linux only")
def test_the_native_build_uses_every_instruction_set_this_cpu_has():
    """The native build (-march=native) has exactly the instruction sets the CPU reports: one
    that lost an instruction set the CPU has (a flag dropped, a cached library from another CPU)
    fails here instead of quietly running slower kernels."""
    library, why = build("native")
    if library is None:
        pytest.skip(f"no native build here: {why}")
    flags = cpu_flags()
    expected = {feature for feature, needs in CPU_FLAGS.items() if needs <= flags}
    assert set(abi.features(library)) == expected


@pytest.mark.parametrize("name", list(TARGETS))
def test_every_target_this_cpu_runs_compiles(name):
    """A build that fails to compile must fail here, not turn every kernel test into a skip."""
    from minillama.native.build import compiler, target_available

    if not target_available(name) or compiler() is None:
        pytest.skip(f"this CPU does not run {name} builds, or there is no C++ compiler")
    library, why = build(name)
    assert library is not None, why


def test_a_first_run_on_a_terminal_says_the_kernels_are_compiling(monkeypatch, capsys):
    """Compiling takes about a minute the first time on a machine: on a terminal the backend says
    so before it starts and how long it took, instead of leaving the screen blank; nothing is said
    when the build is cached or stderr is not a terminal (a pipe, the tests)."""
    import sys

    from minillama.native import backend as switch

    class Terminal:
        def __init__(self):
            self.text = ""

        def isatty(self):
            return True

        def write(self, s):
            self.text += s

        def flush(self):
            pass

    for needs, expected in ((True, "compiling the kernels for this CPU"), (False, "")):
        terminal = Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        monkeypatch.setattr(switch, "_libraries", {})
        monkeypatch.setattr(switch, "needs_compiling", lambda target, needs=needs: needs)
        monkeypatch.setattr(switch, "build", lambda target: (None, "a test"))
        switch._load("native")
        assert terminal.text.startswith(expected) and (" failed\n" in terminal.text) == needs
