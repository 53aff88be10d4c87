"""Rotary position embeddings (RoFormer, Su et al. 2021) in Hugging Face's rotate-half layout.

The first half of each head's channels pairs with the second half; ``rope_scaling`` types
``linear`` (position interpolation) and ``llama3`` (Meta's frequency-banded scaling) follow
``transformers.modeling_rope_utils`` so logits match HF exactly.
"""

from __future__ import annotations

import math

import torch

from minillama.errors import UserError
from minillama.model.config import LlamaConfig


def inverse_frequencies(cfg: LlamaConfig) -> torch.Tensor:
    """Per-pair rotation speeds, float32, shape (head_dim/2,)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))  # (d/2,)
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq  # (d/2,)
        # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, and the
        # band in between is interpolated smoothly.
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise UserError(f"unsupported rope_scaling type {kind!r}: minillama supports linear and llama3")


def rope_tables(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for the given absolute positions, each (T, head_dim), computed in float32."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # (T, d/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (T, d)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, d) by the angles of its positions; cos/sin are (T, d)."""
    return x * cos + rotate_half(x) * sin


class RotaryTable:
    """cos and sin of positions 0..n-1 (n, head_dim), float32, computed once and grown on demand.

    Pre-RoPE keys (``rope=pre``) are rotated when they are read, for positions up to the
    cache's length; a table avoids recomputing those angles at every step. Rows are the
    same numbers ``rope_tables`` gives for those positions."""

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq
        self.cos = self.sin = torch.empty(0, 2 * inv_freq.shape[0], device=inv_freq.device)  # (n, D)
        self.half: tuple[torch.Tensor, torch.Tensor] | None = None  # contiguous (n, D/2) copies for the kernel

    def get(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (n', D) with n' >= n rows."""
        if n > self.cos.shape[0]:
            size = max(n, 2 * self.cos.shape[0], 1024)
            self.cos, self.sin = rope_tables(
                self.inv_freq, torch.arange(size, device=self.inv_freq.device), torch.float32
            )
            d = self.cos.shape[1] // 2
            self.half = (self.cos[:, :d].contiguous(), self.sin[:, :d].contiguous())
        return self.cos, self.sin

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) rows for these positions, each (T, D)."""
        self.get(int(positions.max()) + 1 if positions.numel() else 0)
        return self.cos[positions], self.sin[positions]

    def halves(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (n', D/2) contiguous: one angle per channel pair, as the fused kernel reads them."""
        self.get(n)
        return self.half
