"""Weights kept in llama.cpp's blocks of 32 (minillama/weights): the blocks are llama.cpp's to the
bit, the native product reads them as the reference does, and a model whose projections are
blocks decodes through the native step with the logits of its PyTorch layers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from minillama.errors import UserError
from minillama.kv.cache import KVCache
from minillama.kv.spec import parse_kv
from minillama.native import backend, ops
from minillama.native.abi import NotSupported
from minillama.native.fast import load_model
from minillama.weights.blocks import BLOCK_BYTES, KINDS, dequantize, quantize, round_activations, rounding_bound
from minillama.weights.layers import BlockLinear, quantize_linears, quantize_model
from tests.conftest import make_tiny

gguf = pytest.importorskip("gguf")
GGML = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
        "q4_1": gguf.GGMLQuantizationType.Q4_1}  # fmt: skip
GGML_K = {"q4_k": gguf.GGMLQuantizationType.Q4_K, "q6_k": gguf.GGMLQuantizationType.Q6_K}


def awkward_rows() -> torch.Tensor:
    """Random rows, a block of zeros, one huge weight, and q8_0's rounding ties (x.5 after scaling)."""
    w = torch.randn(24, 256, generator=torch.Generator().manual_seed(0)) * 0.05  # (N, K)
    w[3, :32] = 0
    w[5, 40] = 5.0
    w[7, :32] = torch.arange(32) / 2 - 8
    return w


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_are_the_ones_llama_cpp_writes_and_reads(kind):
    w = awkward_rows()
    ours = quantize(w, kind)  # (N, K / 32 * bytes)
    theirs = gguf.quants.quantize(w.numpy(), GGML[kind])
    assert np.array_equal(ours.numpy(), theirs)
    assert np.array_equal(dequantize(ours, kind).numpy(), gguf.quants.dequantize(theirs, GGML[kind]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_out,n_in,rows", [(7, 576, 1), (576, 1536, 3), (1029, 96, 5), (64, 4096, 16), (3, 32, 21)])
def test_the_native_block_product_equals_the_dequantized_one(lib, kind, n_out, n_in, rows):
    """Every build target (the conftest's lib): rows not a multiple of any tile, 1-21 rows of x."""
    g = torch.Generator().manual_seed(n_out + rows)
    blocks = quantize(torch.randn(n_out, n_in, generator=g) * 0.1, kind)
    x = torch.randn(rows, n_in, generator=g)
    fast = ops.gemm_rows(lib, x, blocks, kind)  # (rows, n_out) float32
    reference = x @ dequantize(blocks, kind).T
    assert torch.allclose(fast, reference, rtol=1e-5, atol=1e-5 * n_in**0.5)  # float sums in another order


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_out,n_in,rows", [(7, 576, 1), (576, 1536, 3), (1029, 96, 5), (64, 4096, 16), (3, 32, 21)])
def test_the_int8_block_product_is_the_product_of_the_rounded_activations(lib, kind, n_out, n_in, rows):
    """With int8 activations (the kernels backend) every build target multiplies the weights with x
    rounded per block (blocks.round_activations), and stays within the stated bound of x's own
    product (float64 here, so the bound is tested, not float rounding)."""
    g = torch.Generator().manual_seed(n_out + rows)
    blocks = quantize(torch.randn(n_out, n_in, generator=g) * 0.1, kind)
    x = torch.randn(rows, n_in, generator=g)
    x[0, :32] = 0  # a block of zeros: scale 0
    x[-1, 5] = 40.0  # an outlier that coarsens its block
    fast = ops.gemm_rows(lib, x, blocks, kind, int8=True)  # (rows, n_out) float32
    w = dequantize(blocks, kind)  # (n_out, n_in)
    rounded = round_activations(x) @ w.T
    assert torch.allclose(fast, rounded, rtol=1e-5, atol=1e-5 * n_in**0.5)
    exact = x.double() @ w.double().T
    assert ((fast.double() - exact).abs() <= rounding_bound(x, w).double() * 1.001 + 1e-5 * n_in**0.5).all()
    assert not torch.allclose(fast, x @ w.T, rtol=1e-6, atol=1e-6)  # the rounding is real: not the float path


def test_rounded_activations_are_int8_codes_times_a_block_scale():
    x = torch.tensor([[0.0] * 32 + [127.0, -63.5, 0.5, 1.5] + [0.0] * 28])  # (1, 64): ties to even
    r = round_activations(x)
    assert torch.equal(r[0, :32], torch.zeros(32))
    assert r[0, 32:36].tolist() == [127.0, -64.0, 0.0, 2.0]
    # x * (127 / amax) with 127 / amax rounded once, as in C: -1.5000001 here (torch's `127 / t`
    # multiplies by a rounded reciprocal and lands on -1.4999999, which rounds to -1)
    y = torch.tensor([[0.9066752791404724, -0.010708763264119625] + [0.0] * 30])  # (1, 32)
    assert round_activations(y)[0, 1] / (0.9066752791404724 / 127) == pytest.approx(-2.0)


def k_blocks(rows: int, cols: int, kind: str, seed: int = 0) -> torch.Tensor:
    """Random k-quant blocks (rows, cols / 256 * bytes) with small fp16 scales (weights ~0.01-0.1):
    any bytes are valid codes, scales and mins."""
    g = np.random.default_rng(seed)
    b = g.integers(0, 256, (rows, cols // 256, BLOCK_BYTES[kind]), dtype=np.uint8)
    half = g.uniform(2e-5, 1e-4, (rows, cols // 256, 2)).astype(np.float16).view(np.uint8)  # (.., 4) bytes
    if kind == "q4_k":
        b[..., 0:4] = half  # d, dmin
    else:
        b[..., 208:210] = half[..., :2]  # d
    return torch.from_numpy(b.reshape(rows, -1))


@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
def test_k_quant_blocks_read_as_llama_cpp_reads_them(kind):
    blocks = k_blocks(5, 512, kind)
    theirs = gguf.quants.dequantize(blocks.numpy(), GGML_K[kind])
    assert np.array_equal(dequantize(blocks, kind).numpy(), theirs)


def test_q6_k_blocks_written_here_are_read_as_llama_cpp_reads_them_within_a_step_of_each_weight():
    w = torch.randn(9, 768, generator=torch.Generator().manual_seed(4)) * torch.logspace(-1, 0, 768)  # (9, 768)
    blocks = quantize(w, "q6_k")
    got = dequantize(blocks, "q6_k")
    assert np.array_equal(got.numpy(), gguf.quants.dequantize(blocks.numpy(), GGML_K["q6_k"]))
    sc = blocks.view(9, 3, 210)[..., 192:208].contiguous().view(torch.int8).float()  # (9, 3, 16): one per 16 weights
    d = blocks.view(9, 3, 210)[..., 208:210].contiguous().view(torch.float16).float()  # (9, 3, 1)
    step = (d * sc).repeat_interleave(16, -1).reshape(9, 768)  # each weight's step (signed)
    ends = torch.minimum(-32 * step, 31 * step), torch.maximum(-32 * step, 31 * step)  # codes -32 .. 31
    beyond = (w - w.clamp(*ends)).abs()  # how far a weight lies outside what its codes reach
    assert ((got - w).abs() <= beyond + step.abs() / 2 * (1 + 1e-5)).all()  # the nearest code
    assert (got - w).norm() / w.norm() < 0.03  # 6 bits: about 2% of the weights' norm
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(torch.randn(2, 288), "q6_k")


@pytest.mark.parametrize("kind,head", [("q4_0", "q6_k"), ("q4_1", "q6_k"), ("q8_0", "q8_0")])
@pytest.mark.parametrize("tied", [False, True])
def test_weights_quantized_at_load_give_the_head_and_embedding_llama_cpps_types(tmp_path, kind, head, tied):
    """llama.cpp's quantizer: a 4-bit model's head in Q6_K (Q8_0 where rows are not whole 256-weight
    blocks: the 192-wide model), a Q8_0 model's in Q8_0; an untied embedding in the model's kind, a
    tied one is the head. The native step reads the Q6_K head as the PyTorch layers do."""
    from minillama.model.loader import load_model as load_reference

    lm = load_model(str(make_tiny(tmp_path, tie_word_embeddings=tied)), "float32", weights=kind)
    assert lm.model.lm_head.kind == head
    assert lm.model.model.embed_tokens.kind == (head if tied else kind)
    assert (lm.model.lm_head.weight is lm.model.model.embed_tokens.weight) == tied
    narrow = load_reference(str(make_tiny(tmp_path / "narrow", hidden_size=192)), "float32")
    quantize_model(narrow.model, kind)
    assert narrow.model.lm_head.kind == "q8_0"
    if backend.library() is None:
        return
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(2))  # (1, T)

    def decode(name: str) -> torch.Tensor:
        cache = KVCache.for_model(lm.config, parse_kv("fp16"), 16)
        with backend.using(name), torch.inference_mode():
            lm.model(ids[:, :8], cache)
            return torch.stack([lm.model(ids[:, t : t + 1], cache)[0, -1] for t in range(8, 12)])  # (4, V)

    reference = decode("reference")
    before = backend.tally()
    native = decode("kernels-exact")
    ran = backend.tally() - before
    assert ran["decode step"] == 4 and not [k for k in ran if k.startswith("fallback")]
    assert torch.allclose(native, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
@pytest.mark.parametrize("n_out,n_in,rows", [(7, 256, 1), (300, 1536, 3), (65, 512, 16), (3, 256, 21)])
def test_the_native_k_quant_products_equal_the_reference(lib, kind, n_out, n_in, rows):
    """Every build target: float activations (the plain loop) and int8 ones (the SIMD kernels)."""
    blocks = k_blocks(n_out, n_in, kind, seed=n_out)
    x = torch.randn(rows, n_in, generator=torch.Generator().manual_seed(rows))
    w = dequantize(blocks, kind)  # (n_out, n_in)
    tol = {"rtol": 1e-5, "atol": 1e-5 * n_in**0.5 * w.abs().max().item()}
    assert torch.allclose(ops.gemm_rows(lib, x, blocks, kind), x @ w.T, **tol)
    assert torch.allclose(ops.gemm_rows(lib, x, blocks, kind, int8=True), round_activations(x) @ w.T, **tol)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(ops.dequantize_rows(lib, blocks, kind, n_in, dtype), w.to(dtype))
    with pytest.raises(NotSupported, match="gemm_rows"):  # rows of 256 weights only
        ops.gemm_rows(lib, torch.randn(1, 224), torch.zeros(2, BLOCK_BYTES[kind], dtype=torch.uint8), kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_widening_of_blocks_is_the_reference_to_the_bit(lib, kind, dtype):
    """What a prompt's chunk multiplies (torch's product on the widened weights): bit for bit."""
    blocks = quantize(torch.randn(37, 160, generator=torch.Generator().manual_seed(3)), kind)
    assert torch.equal(ops.dequantize_rows(lib, blocks, kind, 160, dtype), dequantize(blocks, kind).to(dtype))


def test_a_row_that_is_not_whole_blocks_is_refused(lib):
    with pytest.raises(NotSupported, match="gemm_rows"):
        ops.gemm_rows(lib, torch.randn(1, 48), torch.zeros(4, 34, dtype=torch.uint8), "q8_0")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny(
        tmp_path_factory.mktemp("blocks"), hidden_size=192, intermediate_size=160, head_dim=64, attention_bias=True
    )


@pytest.mark.skipif(backend.library() is None, reason="the kernels did not build here")
@pytest.mark.parametrize("kind", KINDS)
def test_the_native_step_reads_block_weights_as_the_layers_do(model_dir, kind):
    """float32: the whole decode step in one native call (counted) against the PyTorch layers
    (reference backend: each BlockLinear dequantizes, then multiplies)."""
    lm = load_model(str(model_dir), "float32", weights=kind)
    assert isinstance(lm.model.model.layers[0].mlp.down_proj, BlockLinear)
    ids = torch.randint(3, lm.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))  # (B, T)

    def decode(name: str) -> torch.Tensor:
        cache = KVCache.for_model(lm.config, parse_kv("fp16"), 64, batch=2)
        with backend.using(name), torch.inference_mode():
            lm.model(ids[:, :30], cache)
            return torch.stack([lm.model(ids[:, t : t + 1], cache)[:, -1] for t in range(30, 40)])  # (10, B, V)

    reference = decode("reference")
    before = backend.tally()
    native = decode("kernels-exact")
    ran = backend.tally() - before
    assert ran["decode step"] == 10 and not [k for k in ran if k.startswith("fallback")]
    assert ran["block widening"] == 7 * 2 + 1  # the prompt's 60 rows: 7 matrices in 2 layers, the head
    down, x = lm.model.model.layers[0].mlp.down_proj, torch.randn(3, 160)  # a few rows: the block kernel
    with backend.using("reference"):
        expected = down(x)
    before = backend.tally()
    with backend.using("kernels-exact"):
        assert torch.allclose(down(x), expected, atol=1e-5, rtol=1e-5)
    assert (backend.tally() - before)["block product"] == 1
    assert torch.allclose(native, reference, atol=1e-4, rtol=1e-4)
    assert torch.equal(native.argmax(-1), reference.argmax(-1))
    rounded = decode("kernels")  # the activations rounded to int8 per block (the default backend)
    moved = (rounded - reference).abs().max()
    assert 0 < moved < 0.1 * reference.std()


def test_projections_that_are_not_whole_blocks_are_refused_in_one_line(tmp_path):
    from minillama.model.loader import load_model as load_reference

    lm = load_reference(str(make_tiny(tmp_path, hidden_size=72, intermediate_size=96)), "float32")
    with pytest.raises(UserError, match="not a multiple of 32: q4_0 weights need whole blocks"):
        quantize_linears(lm.model, "q4_0")


def test_generate_takes_weights_from_the_command_line(model_dir):
    from minillama.app.cli import cli

    args = ["generate", "hello", "-m", str(model_dir), "--raw", "-n", "4", "--temperature", "0"]
    result = CliRunner().invoke(cli, [*args, "--weights", "q4_1"])
    assert result.exit_code == 0, result.output
    bad = CliRunner().invoke(cli, [*args, "--weights", "q3"])
    assert bad.exit_code == 2 and "q4_1" in bad.stderr
