"""minillama's Llama equals transformers' LlamaForCausalLM on tiny random models.

The model-equality tests run on both backends (``each_backend``: the plain PyTorch reference
and the compiled kernels). Tolerances are set from the error measured on these models with a
stated margin of at most 10x.
"""

from __future__ import annotations

import pytest
import torch

from minillama.kv.cache import KVCache
from minillama.kv.spec import parse_kv
from minillama.native import backend
from minillama.native.fast import load_model
from tests.conftest import make_tiny

CONFIGS = {
    "gqa-untied": dict(),
    "mha-tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "llama3-rope-500k": dict(
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "linear-rope": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "explicit-head-dim": dict(head_dim=32),
    "biases": dict(attention_bias=True, mlp_bias=True),
    "gqa3-head-dim-128": dict(hidden_size=384, num_attention_heads=6, num_key_value_heads=2, head_dim=128),
    "gqa8": dict(num_attention_heads=8, num_key_value_heads=1),
}


def hf_logits(folder, tokens):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(tokens).logits


@pytest.mark.parametrize("name", CONFIGS)
def test_full_forward_logits_match_transformers(tmp_path, name, each_backend):
    folder = make_tiny(tmp_path / name, **CONFIGS[name])
    tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    ours = load_model(str(folder)).model(tokens)
    # measured: <= 6.3e-7 (reference: explicit attention), 0 (kernels: the same SDPA call as HF); logits ~1-2
    assert (ours - hf_logits(folder, tokens)).abs().max() < 5e-6


@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_then_decode_matches_transformers(tmp_path, name, each_backend):
    """float32: a prefill of 10 tokens, then 14 one-token steps over the cache (on the kernels
    backend the native decode step, counted), give transformers' logits of a full forward."""
    folder = make_tiny(tmp_path / name, **CONFIGS[name])
    lm = load_model(str(folder))
    tokens = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(2))
    cache = KVCache.for_model(lm.config, parse_kv("fp32"), capacity=64)
    before = backend.tally()
    with torch.inference_mode():
        steps = [lm.model(tokens[:, :10], cache)]  # prefill 10 tokens
        steps += [lm.model(tokens[:, i : i + 1], cache) for i in range(10, 24)]  # then one at a time
    assert (backend.tally() - before)["decode step"] == (14 if each_backend == "kernels" else 0)
    assert (torch.cat(steps, dim=1) - hf_logits(folder, tokens)).abs().max() < 5e-6  # measured: <= 7.2e-7
    assert cache.position == 24


def test_chunked_prefill_equals_one_shot(tiny, each_backend):
    from minillama.model.generate import prefill

    tokens = list(range(5, 75))
    one = prefill(tiny.model, tokens, KVCache.for_model(tiny.config, parse_kv("fp32"), 128), chunk=512)
    chunked = prefill(tiny.model, tokens, KVCache.for_model(tiny.config, parse_kv("fp32"), 128), chunk=16)
    assert (one - chunked).abs().max() < 1e-5


def test_bfloat16_weights_stay_close_to_float32(tiny_dir, each_backend):
    tokens = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(3))
    f32 = load_model(str(tiny_dir), "float32").model(tokens)
    bf16 = load_model(str(tiny_dir), "bfloat16").model(tokens).float()
    assert load_model(str(tiny_dir), "bfloat16").model.lm_head.weight.dtype == torch.bfloat16
    assert (f32 - bf16).abs().max() < 0.02 * f32.abs().max()  # measured: 0.0094 of max|logit| 1.15 (0.8%)


def bf16_decode(folder, tokens, kv: str = "bf16", prefill: int = 9) -> torch.Tensor:
    """bf16 weights: prefill, then one-token steps; float32 logits of the decoded positions."""
    lm = load_model(str(folder), "bfloat16")
    cache = KVCache.for_model(lm.config, parse_kv(kv), capacity=32, batch=tokens.shape[0])
    with torch.no_grad():
        steps = [lm.model(tokens[:, :prefill], cache)[:, -1:]]
        steps += [lm.model(tokens[:, i : i + 1], cache) for i in range(prefill, tokens.shape[1])]
    return torch.cat(steps, dim=1).float()


@pytest.mark.parametrize("name", ["gqa-untied", "biases"])
def test_bfloat16_decode_with_the_matrix_vector_kernel_matches_transformers(tmp_path, name):
    """bf16 one-token decode steps on the kernels backend (the bf16 matrix-vector kernel) stay as
    close to transformers' float32 logits as the reference's bf16 path does."""
    folder = make_tiny(tmp_path / name, **CONFIGS[name])
    tokens = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(4))
    reference = hf_logits(folder, tokens)[:, 8:]  # (1, 12, V)
    fast = (bf16_decode(folder, tokens) - reference).abs().max().item()
    with backend.using("reference"):
        plain = (bf16_decode(folder, tokens) - reference).abs().max().item()
    assert fast < 0.1 * reference.abs().max() and fast < 2 * plain + 1e-2, (fast, plain)


def test_fused_projections_share_memory_and_change_nothing(tmp_path):
    """The compiled path's loader lays q/k/v and gate/up side by side, one weight each
    (native/weights.py): the separate projections are views of its rows, and the logits equal
    those of the core loader's model, whose projections stand alone."""
    from minillama.model.loader import load_model as load_core
    from minillama.native.weights import fused_rows

    folder = make_tiny(tmp_path / "biases", **CONFIGS["biases"])
    lm = load_model(str(folder))
    attn, mlp = lm.model.model.layers[0].self_attn, lm.model.model.layers[0].mlp
    qkv, qkv_bias = fused_rows([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up, _ = fused_rows([mlp.gate_proj, mlp.up_proj])
    assert attn.q_proj.weight.data_ptr() == qkv.data_ptr()
    assert attn.v_proj.bias.data_ptr() == qkv_bias[-attn.v_proj.bias.numel() :].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == gate_up[mlp.gate_proj.weight.shape[0] :].data_ptr()
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        assert torch.allclose(load_core(str(folder)).model(tokens), lm.model(tokens), atol=1e-5)


@pytest.mark.parametrize("fused", ["sdpa", "kernels"])
@pytest.mark.parametrize("spec", ["fp32", "hadv2", "k=int4h,v=int3h,group=64,residual=32,sinks=4,center=1"])
@pytest.mark.parametrize("t,past", [(1, 0), (7, 0), (5, 40), (1100, 0), (1030, 20)])
def test_fused_chunk_attention_equals_the_explicit_reference(fused, spec, t, past):
    """attend with a fused function -- PyTorch's scaled_dot_product_attention, or the kernels
    backend's choice (the native causal kernel) -- == the explicit masked softmax, with and
    without a (rotated, centered) past, across query blocks."""
    from minillama.kv.spec import parse_kv
    from minillama.model.attention import attend, sdpa
    from minillama.native import step

    s = parse_kv(spec)
    g = torch.Generator().manual_seed(t + past)
    q, k, v = (torch.randn(2, h, t, 64, generator=g) for h in (6, 2, 2))
    stored = (torch.randn(2, 2, past, 64, generator=g), torch.randn(2, 2, past, 64, generator=g)) if past else None
    center = torch.randn(2, 2, 1, 64, generator=g) if s.center and past else None
    reference = attend(q, k, v, stored, s.k, s.v, center)
    lib = backend.library()
    if fused == "kernels" and lib is None:
        pytest.skip("the kernels did not build here")
    fast = attend(q, k, v, stored, s.k, s.v, center, sdpa if fused == "sdpa" else step.chunk_attention(lib))
    assert torch.allclose(fast, reference, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv", ["fp32", "k=fp32,v=fp32,rope=pre"])
def test_the_kernels_backend_decodes_like_the_reference(tmp_path, dtype, kv):
    """A whole decode step on the kernels backend (compiled norms, RoPE, SiLU x up, projections,
    attention) against the reference backend: batch 3, one-token steps after a prefill; float32
    to rounding, bfloat16 within a few ulps."""
    folder = make_tiny(tmp_path / "gqa", **CONFIGS["biases"])
    tokens = torch.randint(0, 300, (3, 14), generator=torch.Generator().manual_seed(6))
    logits = []
    for name in ("kernels-exact", "reference"):
        with backend.using(name):
            lm = load_model(str(folder), dtype)
            cache = KVCache.for_model(lm.config, parse_kv(kv), capacity=32, batch=3)
            with torch.no_grad():
                steps = [lm.model(tokens[:, :6], cache)[:, -1:]]
                steps += [lm.model(tokens[:, i : i + 1], cache) for i in range(6, 14)]
            logits.append(torch.cat(steps, dim=1).float())
    fast, plain = logits
    if dtype == "float32":
        assert (fast - plain).abs().max() < 2e-6  # measured: 3.6e-7 (summation order)
    else:  # measured: 4.8e-7, and one bfloat16 ulp (2^-8 of a logit near 1) with keys stored before RoPE
        assert (fast - plain).abs().max() <= 2 * 2**-8 * plain.abs().max()
