"""A random-weight model of TinyLlama-1.1B's shape, for speed measurements at a larger size.

    python bench/tinyllama_shape.py weights/tinyllama-shape      # writes the folder (~2.1 GB, bf16)
    minillama bench --model weights/tinyllama-shape --kv fp16 --kv hadv2 --context 512 --context 8192 --fill synthetic
    python bench/tinyllama_shape.py weights/tinyllama-q4_0.gguf  # a GGUF: projections q4_0 (or q8_0), rest q8_0
    python bench/peers.py --rounds 5 --gguf weights/tinyllama-q4_0.gguf --context 512   # both engines, that file
    python bench/tinyllama_shape.py weights/tinyllama-q4_k_m.gguf  # Q4_K_M's layout: q4_K, some q6_K

TinyLlama-1.1B: 22 layers, hidden 2048, 32 query heads and 4 KV heads of 64, MLP 5632 (the
Hadamard-value method this project reproduces was reported on it). The weights are seeded
Gaussians (std 0.02, norms 1), so the text it writes is noise: this folder measures speed and
bytes, never quality. The tokenizer (and so the vocabulary, 49152) is the default model's.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from minillama.app.default_model import resolve_model

SHAPE = {
    "num_hidden_layers": 22,
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "intermediate_size": 5632,
}


def write_gguf(out: Path, kind: str) -> None:
    """The same shape as a llama GGUF that llama.cpp and minillama both read: the projections in
    `kind` blocks, the embedding and the head q8_0, the norms F32, the default model's tokenizer
    metadata. Random rows need no q/k permutation: their order means nothing. Kind "q4_k_m" lays
    the file out as llama.cpp's Q4_K_M does: q4_K everywhere but the head and, in every other
    layer, attn_v and ffn_down in q6_K (random codes and small scales: minillama's quantizer
    writes q6_K for heads only, no q4_K)."""
    import gguf

    from minillama.app.default_model import find_gguf
    from minillama.model.gguf_file import GGUFFile
    from minillama.weights.blocks import BLOCK_BYTES, quantize

    source = GGUFFile(find_gguf(install=False))
    writer = gguf.GGUFWriter(str(out), "llama")
    shape = {"llama.block_count": SHAPE["num_hidden_layers"], "llama.embedding_length": SHAPE["hidden_size"],
             "llama.feed_forward_length": SHAPE["intermediate_size"], "llama.attention.head_count":
             SHAPE["num_attention_heads"], "llama.attention.head_count_kv": SHAPE["num_key_value_heads"],
             "llama.rope.dimension_count": 64}  # fmt: skip
    reader = gguf.GGUFReader(str(find_gguf(install=False)))  # for the fields' value types
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = shape.get(name, source.fields[name].contents())
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub)
    g = torch.Generator().manual_seed(0)
    code = {k: getattr(gguf.GGMLQuantizationType, k.upper()) for k in ("q4_0", "q8_0", "q4_k", "q6_k")}
    rng = np.random.default_rng(0)

    def blocks(name: str, rows: int, cols: int, as_kind: str) -> None:
        if as_kind in ("q4_k", "q6_k"):  # any codes; fp16 scales small enough for weights ~0.01-0.1
            data = rng.integers(0, 256, (rows, cols // 256, BLOCK_BYTES[as_kind]), dtype=np.uint8)
            halves = 2 if as_kind == "q4_k" else 1  # d and dmin at byte 0, or q6_k's d at byte 208
            at = 0 if as_kind == "q4_k" else 208
            scales = rng.uniform(2e-5, 1e-4, (rows, cols // 256, halves)).astype(np.float16).view(np.uint8)
            data[..., at : at + 2 * halves] = scales
            data = data.reshape(rows, -1)
        else:
            data = quantize(torch.randn(rows, cols, generator=g) * 0.02, as_kind).numpy()  # (rows, bytes)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=code[as_kind])

    h, i, d = SHAPE["hidden_size"], SHAPE["intermediate_size"], 64
    hq, hkv, vocab = (
        SHAPE["num_attention_heads"],
        SHAPE["num_key_value_heads"],
        len(source.fields["tokenizer.ggml.tokens"].contents()),
    )
    k_m = kind == "q4_k_m"
    blocks("token_embd.weight", vocab, h, "q4_k" if k_m else "q8_0")
    writer.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    blocks("output.weight", vocab, h, "q6_k" if k_m else "q8_0")
    for n in range(SHAPE["num_hidden_layers"]):
        for part, rows, cols in (("attn_q", hq * d, h), ("attn_k", hkv * d, h), ("attn_v", hkv * d, h),
                                 ("attn_output", h, hq * d), ("ffn_gate", i, h), ("ffn_up", i, h), ("ffn_down", h, i)):  # fmt: skip
            more = part in ("attn_v", "ffn_down") and n % 2 == 0
            blocks(f"blk.{n}.{part}.weight", rows, cols, ("q6_k" if more else "q4_k") if k_m else kind)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{n}.{norm}.weight", np.ones(h, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {out}: {kind} layout, random (speed only)")


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "weights/tinyllama-shape")
    if out.suffix == ".gguf":
        return write_gguf(out, next((k for k in ("q8_0", "q4_k_m") if k in out.name), "q4_0"))
    source = Path(resolve_model(None))  # the default model's folder: its tokenizer and config keys
    cfg = json.loads((source / "config.json").read_text())
    cfg.update(SHAPE, head_dim=64, tie_word_embeddings=False, torch_dtype="bfloat16")
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    hq, hkv, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    state = {
        "model.embed_tokens.weight": w(vocab, h),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": w(vocab, h),
    }
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        state |= {
            p + "self_attn.q_proj.weight": w(hq * d, h),
            p + "self_attn.k_proj.weight": w(hkv * d, h),
            p + "self_attn.v_proj.weight": w(hkv * d, h),
            p + "self_attn.o_proj.weight": w(h, hq * d),
            p + "mlp.gate_proj.weight": w(i, h),
            p + "mlp.up_proj.weight": w(i, h),
            p + "mlp.down_proj.weight": w(h, i),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        }
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    params = sum(t.numel() for t in state.values())
    print(f"wrote {out}: {params / 1e9:.2f}B parameters, bf16, random (speed only)")


if __name__ == "__main__":
    main()
