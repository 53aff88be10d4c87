"""A random-weight model of TinyLlama-1.1B's shape, for speed measurements at a larger size.

    python bench/tinyllama_shape.py weights/tinyllama-shape      # writes the folder (~2.1 GB, bf16)
    minillama bench --model weights/tinyllama-shape --kv fp16 --kv hadv2 --context 512 --context 8192 --fill synthetic

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


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "weights/tinyllama-shape")
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
