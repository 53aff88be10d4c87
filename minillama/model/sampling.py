"""Next-token sampling: temperature, top-k, top-p (nucleus), min-p and a repeat penalty.

Pure functions of the logits; randomness comes only from the explicit torch.Generator.
Temperature 0 means greedy (argmax).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillama.errors import UserError, finite, shown


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repeat_penalty: float = 1.0  # 1 = off (CTRL-style: divide positive logits, multiply negative)

    def __post_init__(self):
        # Refused here rather than met as "probability tensor contains inf, nan" mid-generation.
        for name, low, high in (
            ("temperature", 0, None),
            ("top_p", 0, 1),
            ("min_p", 0, 1),
            ("repeat_penalty", 0.01, None),
        ):
            value = finite(getattr(self, name), name)
            if value < low or (high is not None and value > high):
                raise UserError(f"{name} must be in [{low}, {high if high is not None else 'inf'}), not {value}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise UserError(f"top_k must be a whole number >= 0, not {shown(self.top_k)}")


def apply_repeat_penalty(logits: torch.Tensor, previous: list[int], penalty: float) -> torch.Tensor:
    if penalty == 1.0 or not previous:
        return logits
    ids = torch.tensor(sorted(set(previous)), device=logits.device)
    picked = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits (V,) float32 after temperature -> logits with excluded tokens at -inf."""
    if p.top_k > 0:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.min_p > 0:
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None = None, previous: list[int] | None = None
) -> int:
    """One token id from logits (V,)."""
    logits = apply_repeat_penalty(logits.float(), previous or [], p.repeat_penalty)
    if p.temperature <= 0:
        return int(torch.argmax(logits))
    logits = filter_logits(logits / p.temperature, p)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
