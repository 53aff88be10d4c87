"""A GGUF file loaded with its weights as stored (minillama/weights/gguf.py): the default model's
own Q4_1 file reads exactly as its dequantized folder, decodes through the native step, and a
damaged file or a tensor type kept as floats says so in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from minillama.app.cli import cli
from minillama.kv.cache import KVCache
from minillama.kv.spec import parse_kv
from minillama.native import backend
from minillama.native.fast import load_model
from minillama.weights.layers import BlockEmbedding, BlockLinear

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def gguf_path(default_model_dir):
    from minillama.app.default_model import find_gguf

    return find_gguf(install=False)


def rewrite(src, dst, change) -> None:
    """Copy a GGUF file, each tensor's (data, type) as change(tensor) says."""
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for name, f in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for t in reader.tensors:
        data, kind = change(t)
        writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def to_q8_0(name: str):
    """A `rewrite` change: tensor `name` requantized to Q8_0, every other tensor as it is."""

    def change(t):
        if t.name == name:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
            return gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
        return t.data, t.tensor_type

    return change


def last_steps(lm, ids: torch.Tensor, name: str, steps: int, batch: int = 1) -> torch.Tensor:
    """The logits of the last `steps` tokens of ids (1, T), decoded one at a time after a prefill of
    the rest, on backend `name`, for `batch` copies of the sequence -> (steps, batch, vocab)."""
    x = ids.repeat(batch, 1)  # (batch, T)
    cache = KVCache.for_model(lm.config, parse_kv("fp16"), x.shape[1] + 4, batch=batch)
    with backend.using(name), torch.inference_mode():
        lm.model(x[:, :-steps], cache)
        return torch.stack([lm.model(x[:, t : t + 1], cache)[:, -1] for t in range(x.shape[1] - steps, x.shape[1])])


@pytest.mark.slow
def test_the_default_models_q4_1_file_reads_as_its_dequantized_folder(gguf_path, smollm):
    """Its blocks stay blocks (the projections Q4_1, the tied embedding and head Q8_0); the PyTorch
    reference dequantizes them to exactly the folder's float32 weights, and the native step that
    multiplies them in place gives the reference's logits."""
    lm = load_model(str(gguf_path), "float32")
    layer = lm.model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, BlockLinear) and layer.mlp.down_proj.kind == "q4_1"
    assert (
        isinstance(lm.model.model.embed_tokens, BlockEmbedding)
        and lm.model.lm_head.weight is lm.model.model.embed_tokens.weight
    )
    ids = torch.tensor([smollm.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")])

    def decode(model, name: str) -> torch.Tensor:
        cache = KVCache.for_model(lm.config, parse_kv("fp16"), 64)
        with backend.using(name), torch.inference_mode():
            out = [model(ids[:, :-4], cache)[:, -1]]
            out += [model(ids[:, t : t + 1], cache)[:, -1] for t in range(ids.shape[1] - 4, ids.shape[1])]
        return torch.stack(out)  # (5, 1, vocab)

    reference = decode(lm.model, "reference")
    assert torch.equal(reference, decode(smollm.model, "reference"))  # the same weights, to the bit
    before = backend.tally()
    native = decode(lm.model, "kernels-exact")
    assert (backend.tally() - before)["decode step"] == 4
    # the folder's own float32 weights differ as much between these two paths (4.3e-3 measured):
    # float sums in another order over 30 layers, and an fp16 cache rounding them
    assert (native - reference).abs().max() < 1e-2
    assert torch.equal(native.argmax(-1), reference.argmax(-1))


def test_a_tensor_type_not_kept_as_blocks_is_dequantized_with_a_note(gguf_path, tmp_path):
    def to_f16(t):
        if t.name == "blk.0.ffn_down.weight":
            return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float16), gguf.GGMLQuantizationType.F16
        return t.data, t.tensor_type

    rewrite(gguf_path, tmp_path / "f16.gguf", to_f16)
    lm = load_model(str(tmp_path / "f16.gguf"), "bfloat16")
    assert lm.notes == [
        "note: F16 tensors are dequantized to bfloat16 (blocks are read as stored for Q8_0, Q4_0, Q4_1, Q4_K and Q6_K only)"
    ]
    down = lm.model.model.layers[0].mlp.down_proj
    assert not isinstance(down, BlockLinear) and down.weight.dtype == torch.bfloat16
    result = CliRunner().invoke(cli, ["generate", "hi", "-m", str(tmp_path / "f16.gguf"), "-n", "2", "--raw"])
    assert result.exit_code == 0 and lm.notes[0] in result.stderr


@pytest.mark.parametrize("keep", [1000, 60_000_000])  # inside the header; inside the tensors
def test_a_truncated_gguf_is_refused_in_one_line(gguf_path, tmp_path, keep):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_path.read_bytes()[:keep])
    result = CliRunner().invoke(cli, ["generate", "hi", "-m", str(cut), "-n", "2"])
    assert result.exit_code == 1 and "is not a readable GGUF file" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def lying_gguf(path, cols: int, offset: int) -> str:
    """A GGUF header of one Q8_0 tensor (cols x 2) at `offset` in the data, and 64 bytes of data."""
    import struct

    name = b"output.weight"
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 0)  # version, tensors, fields
    info = struct.pack("<Q", len(name)) + name + struct.pack("<IQQIQ", 2, cols, 2, 8, offset)  # dims, Q8_0
    body = head + info
    path.write_bytes(body + bytes(-len(body) % 32) + bytes(64))
    return str(path)


@pytest.mark.parametrize(
    "cols,offset,says", [(33, 0, "not whole Q8_0 blocks"), (64, 1 << 40, "runs past the end of the file")]
)
def test_a_gguf_whose_tensors_lie_is_refused_in_one_line_before_reading_them(tmp_path, cols, offset, says):
    from minillama.model.gguf_file import GGUFFile

    path = lying_gguf(tmp_path / "lies.gguf", cols, offset)
    with pytest.raises(ValueError, match=says):
        GGUFFile(path)
    result = CliRunner().invoke(cli, ["generate", "hi", "-m", path, "-n", "2"])
    assert result.exit_code == 1 and "is not a readable GGUF file" in result.stderr and says in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_weights_are_not_requantized_from_a_gguf(gguf_path):
    result = CliRunner().invoke(cli, ["generate", "hi", "-m", str(gguf_path), "--weights", "q4_0"])
    assert result.exit_code == 1 and "a GGUF's weights are used as stored" in result.stderr


def test_the_default_model_runs_from_its_own_gguf_on_a_cpu(gguf_path):
    from minillama.app.default_model import resolve_weights

    assert resolve_weights(None, "cpu", None) == str(gguf_path)
    assert not resolve_weights(None, "cpu", "q4_0").endswith(".gguf")  # --weights quantizes the folder
    assert not resolve_weights(None, "cuda", None).endswith(".gguf")  # blocks run on the CPU only


def test_the_header_reader_reads_what_the_gguf_package_reads(gguf_path):
    """model/gguf_file.py parses the header itself (the gguf package's reader is slow and large
    on a big vocabulary): the same fields, the same tensors, the same bytes."""
    from minillama.model.gguf_file import GGUFFile

    ours, theirs = GGUFFile(gguf_path), gguf.GGUFReader(str(gguf_path))
    assert set(ours.fields) == {k for k in theirs.fields if not k.startswith("GGUF.")}
    for key in ("general.architecture", "llama.block_count", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
        assert ours.fields[key].contents() == theirs.fields[key].contents(), key
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.shape, a.tensor_type) == (b.name, b.shape.tolist(), b.tensor_type)
        assert np.array_equal(a.data.reshape(b.data.shape), b.data), a.name


def test_k_quant_tensors_are_kept_as_blocks_and_decode_natively(gguf_path, tmp_path):
    """Q4_K and Q6_K (the types of a Q4_K_M download) stay blocks, with no note, and the native step
    multiplies them in place as the reference does (random blocks: the test is of the arithmetic)."""
    from tests.test_block_weights import k_blocks

    kinds = {"blk.0.ffn_down.weight": "q4_k", "blk.1.ffn_down.weight": "q6_k"}

    def to_k(t):
        if t.name in kinds:
            rows, cols = int(t.shape[1]), int(t.shape[0])  # GGUF shapes are (in, out)
            data = k_blocks(rows, cols, kinds[t.name]).numpy()
            return data, getattr(gguf.GGMLQuantizationType, kinds[t.name].upper())
        return t.data, t.tensor_type

    rewrite(gguf_path, tmp_path / "k.gguf", to_k)
    lm = load_model(str(tmp_path / "k.gguf"), "float32")
    assert lm.notes == []
    assert [lm.model.model.layers[i].mlp.down_proj.kind for i in (0, 1)] == ["q4_k", "q6_k"]
    ids = torch.tensor([lm.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")])
    reference = last_steps(lm, ids, "reference", 4)
    before = backend.tally()
    native = last_steps(lm, ids, "kernels-exact", 4)
    assert (backend.tally() - before)["decode step"] == 4
    assert (native - reference).abs().max() < 1e-2


@pytest.mark.parametrize(
    "tensor,part", [("blk.0.attn_v.weight", "self_attn.v_proj"), ("blk.0.ffn_up.weight", "mlp.up_proj")]
)
def test_projections_of_one_input_stored_in_different_types_decode_in_one_native_step(
    gguf_path, tmp_path, tensor, part
):
    """Q4_K_M keeps some layers' v rows in Q6_K beside Q4_K q and k: here v (or up, beside gate)
    becomes Q8_0 beside Q4_1. The step multiplies the group's parts apart, into one row, as the
    reference multiplies each layer."""
    rewrite(gguf_path, tmp_path / "mixed.gguf", to_q8_0(tensor))
    lm = load_model(str(tmp_path / "mixed.gguf"), "float32")
    module, name = part.split(".")
    assert getattr(getattr(lm.model.model.layers[0], module), name).kind == "q8_0"
    ids = torch.tensor([lm.tokenizer.encode("The capital of France is")])
    reference = last_steps(lm, ids, "reference", 2)
    before = backend.tally()
    native = last_steps(lm, ids, "kernels-exact", 2)
    ran = backend.tally() - before
    assert ran["decode step"] == 2 and not [k for k in ran if k.startswith("fallback")]
    assert (native - reference).abs().max() < 1e-2
    assert (last_steps(lm, ids, "kernels-exact", 2, batch=2) - reference).abs().max() < 1e-2  # y's columns strided
