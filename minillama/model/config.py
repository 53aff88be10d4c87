"""Model configuration: a frozen dataclass built from a Hugging Face ``config.json``.

Field names are Hugging Face's, so a reader can hold this file next to any Llama
``config.json``. Unknown keys are ignored, missing required keys are a clear error, and
derived sizes (``head_dim``, ``n_kv_heads``) are properties. Runtime sizes such as the cache
capacity or batch size belong to the cache, not here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from minillama.errors import UserError, shown

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
    def from_dict(cls, d: dict[str, Any], where: str = "config.json") -> LlamaConfig:
        """The config of a ``config.json`` read into `d`; every problem is a UserError that names
        `where` (the file) and the field."""
        if not isinstance(d, dict):
            raise UserError(f"{where} must hold a JSON object of settings, not a {type(d).__name__}")
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(
                f"{where}: unsupported model_type {shown(model_type)}: minillama runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} models only"
            )
        if model_type == "mistral" and d.get("sliding_window") is not None:
            raise UserError(f"{where}: mistral with sliding_window is not supported: set sliding_window to null")
        missing = [k for k in REQUIRED if d.get(k) is None]
        if missing:
            raise UserError(f"{where} is missing required keys: {', '.join(missing)}")
        if d.get("hidden_act", "silu") != "silu":
            raise UserError(
                f"{where}: unsupported hidden_act {shown(d['hidden_act'])}: only silu (SwiGLU) Llamas are supported"
            )
        check_fields(d, where)
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
        check_rope(kwargs.get("rope_theta", 10000.0), kwargs.get("rope_scaling"), where)
        cfg = cls(**kwargs)
        if cfg.num_attention_heads % cfg.n_kv_heads:
            raise UserError(
                f"{where}: num_attention_heads ({cfg.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({cfg.n_kv_heads})"
            )
        return cfg

    @classmethod
    def from_file(cls, path: Path) -> LlamaConfig:
        try:
            return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")), str(path))
        except FileNotFoundError:
            raise UserError(f"{path} not found: a model folder needs a config.json") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{path} is not valid JSON ({str(e)[:100]})") from None
        except OSError as e:
            raise UserError(f"cannot read {path}: {e.strerror or e}") from None


# The types of the fields minillama reads (HF names); anything else in config.json is ignored.
SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias")
TOKEN_IDS = ("bos_token_id", "eos_token_id")


def _whole(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_fields(d: dict[str, Any], where: str) -> None:
    """Every field minillama reads has the JSON type it needs (a size a positive integer, a flag a
    boolean, eps a finite number >= 0), so a bad file fails here by name, not deep in torch."""
    for key in SIZES:
        value = d.get(key)
        if value is not None and not (_whole(value) and value > 0):
            raise UserError(f"{where}: {key} must be a positive whole number, not {shown(value)}")
    for key in FLAGS:
        if key in d and not isinstance(d[key], bool):
            raise UserError(f"{where}: {key} must be true or false, not {shown(d[key])}")
    for key in TOKEN_IDS:
        value = d.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(_whole(i) and i >= 0 for i in ids):
            raise UserError(f"{where}: {key} must be a token id or a list of them, not {shown(value)}")
    eps = d.get("rms_norm_eps", 1e-6)
    if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps) and eps >= 0):
        raise UserError(f"{where}: rms_norm_eps must be a finite number >= 0, not {shown(eps)}")
    for key in ("rope_scaling", "rope_parameters"):
        if d.get(key) is not None and not isinstance(d[key], dict):
            raise UserError(f"{where}: {key} must be an object or null, not {shown(d[key])}")


ROPE_NEEDS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def check_rope(theta: Any, scaling: dict | None, where: str) -> None:
    """rope_theta a positive number; rope_scaling of a type rope.py implements, with its numbers."""
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise UserError(f"{where}: rope_theta must be a positive number, not {shown(theta)}")
    if not scaling:
        return
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_NEEDS:
        raise UserError(f"{where}: unsupported rope_scaling type {shown(kind)}: minillama supports linear and llama3")
    for key in ROPE_NEEDS[kind]:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise UserError(f"{where}: rope_scaling {kind} needs {key} as a positive number, not {shown(value)}")
    if kind == "llama3" and scaling["low_freq_factor"] >= scaling["high_freq_factor"]:
        raise UserError(f"{where}: rope_scaling llama3 needs low_freq_factor < high_freq_factor")
