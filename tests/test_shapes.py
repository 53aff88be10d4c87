"""Every model shape runs every preset: GQA ratios 1-16, head_dim 64, 80, 96 and 128, no crash.

A Llama with 12 or 16 query heads per KV head used to crash the process (SIGSEGV) under
``--kv kivi4``: the integer kernels keep per-head arrays for at most 8. The kernels now state
what they support (native/minillama.h: route_supported) and the planner routes every part to
a kernel that can read it, or the layer to the reference attention with the reason recorded.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from minillama.eval.synthetic import fill_synthetic
from minillama.kv.cache import KVCache
from minillama.kv.spec import PRESETS, parse_kv
from minillama.model.attention import attend
from minillama.model.generate import GenerateOptions, generate
from minillama.model.sampling import SamplingParams
from minillama.native import backend
from minillama.native.fast import load_model
from minillama.native.plans import fused_decode_attention
from tests.conftest import make_tiny

RATIOS = [1, 2, 3, 4, 7, 8, 12, 16]  # query heads per KV head
# Every ratio at the power-of-two head sizes; two ratios at 80 and 96 (Phi-2, Phi-3-mini), whose
# groups are fitted to the head and whose rotations run in power-of-two blocks (64 + 16, 64 + 32).
SHAPES = [(r, d) for r in RATIOS for d in (64, 128)] + [(r, d) for r in (1, 16) for d in (80, 96)]
needs_kernels = pytest.mark.skipif(backend.library() is None, reason="the kernels did not build here")


def kv_heads(ratio: int) -> int:
    return 2 if ratio <= 4 else 1  # several KV heads where the model stays small


@pytest.fixture(scope="module", params=SHAPES, ids=lambda p: f"gqa{p[0]}-d{p[1]}")
def shaped(request, tmp_path_factory):
    """A one-layer random Llama with this GQA ratio and head_dim (hidden 336, divisible by every head count)."""
    ratio, head_dim = request.param
    folder = make_tiny(
        tmp_path_factory.mktemp(f"gqa{ratio}-d{head_dim}"),
        num_hidden_layers=1,
        hidden_size=336,
        intermediate_size=128,
        head_dim=head_dim,
        num_attention_heads=ratio * kv_heads(ratio),
        num_key_value_heads=kv_heads(ratio),
    )
    return load_model(str(folder), "float32")


@needs_kernels
@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_decodes_100_tokens_on_every_shape(shaped, preset):
    prompt = list(range(3, 11))
    cache = KVCache.for_model(shaped.config, parse_kv(preset), 128)
    before = backend.tally()
    tokens = [t for t, _ in generate(shaped.model, prompt, cache, GenerateOptions(100, SamplingParams(temperature=0)))]
    assert len(tokens) == 100 and cache.position == 8 + 99
    ran = backend.tally() - before
    assert ran["decode step"] == 99  # every step in one native call ...
    assert not [k for k in ran if k.startswith("fallback")]  # ... and every part of it on a kernel


@needs_kernels
@pytest.mark.parametrize("ratio,head_dim", SHAPES, ids=lambda p: str(p))
@pytest.mark.parametrize("preset", PRESETS)
def test_the_kernels_attend_like_the_reference_on_every_shape(ratio, head_dim, preset):
    """One decode step's attention over a filled cache: the exact kernels to float rounding."""
    h = kv_heads(ratio)
    cache = KVCache(parse_kv(preset), n_layers=1, n_kv_heads=h, head_dim=head_dim, capacity=160)
    fill_synthetic(cache, 150, chunk=37)
    g = torch.Generator().manual_seed(ratio)
    q = torch.randn(1, h * ratio, 1, head_dim, generator=g)
    k, v = torch.randn(1, h, 1, head_dim, generator=g), torch.randn(1, h, 1, head_dim, generator=g)
    view = cache.layer(0)
    reference = attend(q, k, v, view.read(torch.float32), view.k_codec, view.v_codec, view.key_center)
    with backend.using("kernels-exact"):
        fused = fused_decode_attention(backend.library(), q, k, v, view)
    assert torch.allclose(fused, reference, atol=2e-5, rtol=1e-4)


@needs_kernels
def test_a_head_dim_no_kernel_supports_takes_the_reference_with_the_reason(tmp_path):
    """head_dim 640: the attention kernels keep rows of at most 512 floats, so decode attention
    runs the reference for that layer, says why, and the logits equal the reference backend's."""
    folder = make_tiny(
        tmp_path / "wide",
        num_hidden_layers=1,
        hidden_size=64,
        intermediate_size=64,
        head_dim=640,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    lm = load_model(str(folder), "float32")
    t = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    outs = []
    for name in ("kernels", "reference"):
        with backend.using(name), torch.no_grad():
            cache = KVCache.for_model(lm.config, parse_kv("fp16"), 32)
            outs.append(
                torch.cat([lm.model(t[:, :4], cache)] + [lm.model(t[:, i : i + 1], cache) for i in range(4, 12)], 1)
            )
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    assert any("head_dim the kernel does not support" in reason for reason in backend.fallbacks())


@needs_kernels
@pytest.mark.parametrize("kv", ["kivi4", "hadv2"])
def test_sixteen_query_heads_per_kv_head_generate_from_the_command_line(tmp_path, kv):
    """The reproduction from the issue: 16 query heads, 1 KV head, 100 tokens (was exit 139)."""
    folder = make_tiny(
        tmp_path / "gqa16", num_hidden_layers=2, hidden_size=1024, num_attention_heads=16, num_key_value_heads=1
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "minillama",
            "generate",
            "The capital of France is the city of",
            "--model",
            str(folder),
            "--kv",
            kv,
            "--max-tokens",
            "100",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "generated 100 tokens" in done.stderr
