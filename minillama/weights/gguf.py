"""A llama GGUF file loaded with its weights as stored: llama.cpp's q8_0, q4_0, q4_1, q4_K and q6_K tensors
become ``BlockLinear`` / ``BlockEmbedding`` layers over the file's own blocks (layers.py), so a
4-bit download stays 4-bit in memory and in every decode step.

The file is memory-mapped (model/gguf.py: open_gguf) and checked before anything is allocated:
every tensor's bytes must be the blocks its shape needs (model/gguf_file.py), and every tensor
the one the config expects (``check_tensors``). Tensors in other types (F16, F32
matrices, q5_0, q5_K...) are dequantized to the model's dtype, each kind named once in
``LoadedModel.notes``; the norms (F32) are small and read as floats. The config and tokenizer
come from the file's metadata, written to a temporary folder and read by the core's loaders.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from minillama.errors import UserError
from minillama.model.config import LlamaConfig
from minillama.model.gguf import hf_name, hf_rows, open_gguf, write_model_files
from minillama.model.llama import Llama
from minillama.model.loader import DTYPES, LoadedModel, check_device
from minillama.model.rope import inverse_frequencies
from minillama.model.tokenizer import load_tokenizer, read_json
from minillama.weights.blocks import BLOCK_BYTES, WEIGHTS
from minillama.weights.layers import BlockEmbedding, BlockLinear

GGML_KINDS = {8: "q8_0", 2: "q4_0", 3: "q4_1", 12: "q4_k", 14: "q6_k"}  # GGMLQuantizationType values kept as blocks


def load_gguf(path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu") -> LoadedModel:
    """The llama model in a GGUF file, its q8_0 / q4_0 / q4_1 / q4_K / q6_K weights kept as blocks."""
    from gguf import quants

    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    check_device(str(device))
    if str(device) != "cpu":
        raise UserError("a GGUF's block weights run on the CPU: use --device cpu (or convert it to a folder)")
    path = Path(path)
    reader = open_gguf(path)
    with tempfile.TemporaryDirectory() as tmp:
        tied = not any(t.name == "output.weight" for t in reader.tensors)
        write_model_files(reader, Path(tmp), tied)
        cfg = LlamaConfig.from_file(Path(tmp) / "config.json")
        tokenizer, gen = load_tokenizer(Path(tmp)), read_json(Path(tmp) / "generation_config.json", {})
    with torch.device("meta"):
        model = Llama(cfg)
    blocks: dict[str, tuple[torch.Tensor, str]] = {}
    state: dict[str, torch.Tensor] = {}
    notes: set[str] = set()
    for t in reader.tensors:
        name, kind = hf_name(t.name), GGML_KINDS.get(int(t.tensor_type))
        if kind and len(t.shape) == 2:
            blocks[name] = (torch.from_numpy(hf_rows(reader, t.name, t.data).copy()), kind)  # (out, in / 32 * bytes)
        else:
            w = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            state[name] = torch.from_numpy(hf_rows(reader, t.name, w).copy()).to(dtype)
            if len(t.shape) == 2 and t.tensor_type.name != "F32":
                to = str(dtype).removeprefix("torch.")
                notes.add(f"note: {t.tensor_type.name} tensors are dequantized to {to} (blocks are read as stored "
                          "for Q8_0, Q4_0, Q4_1, Q4_K and Q6_K only)")  # fmt: skip
    check_tensors(model, state, blocks)
    model.load_state_dict(state, strict=False, assign=True)
    place_blocks(model, blocks, dtype)
    model.inv_freq = inverse_frequencies(cfg)
    return LoadedModel(model.eval().requires_grad_(False), tokenizer, cfg, path, gen, sorted(notes))


def check_tensors(model: Llama, state: dict, blocks: dict) -> None:
    """Every tensor the model needs, no other, each of its shape (blocks: its rows of blocks)."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    given = set(state) | set(blocks)
    if missing := sorted(set(expected) - given):
        raise UserError(f"the GGUF is missing {len(missing)} tensor(s), first {missing[0]!r}")
    if unexpected := sorted(given - set(expected)):
        raise UserError(f"the GGUF has a tensor {unexpected[0]!r} its config does not expect")
    for key, shape in expected.items():
        if key in blocks:
            rows, kind = blocks[key]
            got, want = tuple(rows.shape), (shape[0], shape[1] // WEIGHTS[kind] * BLOCK_BYTES[kind])
        else:
            got, want = tuple(state[key].shape), shape
        if got != want:
            raise UserError(f"shape mismatch for {key}: the GGUF has {got}, its config expects {want}")


def place_blocks(model: Llama, blocks: dict, dtype: torch.dtype) -> None:
    """The block tensors as the layers that read them; a tied head reads the embedding's blocks."""
    hidden = model.config.hidden_size
    for key, (rows, kind) in blocks.items():
        if key == "model.embed_tokens.weight":
            model.model.embed_tokens = BlockEmbedding(rows, kind, hidden, dtype)
        elif key == "lm_head.weight":
            model.lm_head = BlockLinear(rows, kind, hidden)
        else:
            _, _, i, part, name, _ = key.split(".")
            module = getattr(model.model.layers[int(i)], part)
            setattr(module, name, BlockLinear(rows, kind, getattr(module, name).in_features))
    if model.config.tie_word_embeddings:
        embed = model.model.embed_tokens
        if isinstance(embed, BlockEmbedding):
            model.lm_head = BlockLinear(embed.weight, embed.kind, hidden)
            model.lm_head.weight = embed.weight  # one tensor, as the tie is
        else:
            model.tie_weights()
