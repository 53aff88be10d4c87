"""Model configuration: a frozen dataclass built from a Hugging Face ``config.json``.

Field names are Hugging Face's, so a reader can hold this file next to any Llama
``config.json``. Unknown keys are ignored, missing required keys are a clear error, and
derived sizes (``head_dim``, ``n_kv_heads``) are properties. Runtime sizes such as the cache
capacity or batch size belong to the cache, not here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from minillama.errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "mistral")
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim_override: int | None = None  # HF "head_dim"; None means hidden_size // heads
    model_type: str = "llama"
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | list[int] | None = None
    eos_token_id: int | list[int] | None = None

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden_size // self.num_attention_heads

    @property
    def n_kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(
                f"unsupported model_type {model_type!r}: minillama runs {', '.join(SUPPORTED_MODEL_TYPES)} models only"
            )
        if model_type == "mistral" and d.get("sliding_window") is not None:
            raise UserError("mistral with sliding_window is not supported: set sliding_window to null in config.json")
        missing = [k for k in REQUIRED if k not in d]
        if missing:
            raise UserError(f"config.json is missing required keys: {', '.join(missing)}")
        if d.get("hidden_act", "silu") != "silu":
            raise UserError(f"unsupported hidden_act {d['hidden_act']!r}: only silu (SwiGLU) Llamas are supported")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        kwargs["head_dim_override"] = d.get("head_dim")
        # transformers >= 5 nests rope settings in "rope_parameters"; older files use
        # "rope_theta" + "rope_scaling". Accept both.
        params = d.get("rope_parameters")
        if params:
            kwargs["rope_theta"] = params.get("rope_theta", kwargs.get("rope_theta", 10000.0))
            if params.get("rope_type", "default") != "default":
                kwargs["rope_scaling"] = dict(params)
        cfg = cls(**kwargs)
        if cfg.num_attention_heads % cfg.n_kv_heads:
            raise UserError("num_attention_heads must be a multiple of num_key_value_heads")
        return cfg

    @classmethod
    def from_file(cls, path: Path) -> "LlamaConfig":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except FileNotFoundError:
            raise UserError(f"{path} not found: a model folder needs a config.json") from None
        except json.JSONDecodeError as e:
            raise UserError(f"{path} is not valid JSON ({e})") from None
