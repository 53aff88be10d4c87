"""Generation as plain functions: prefill a prompt into the cache, then decode step by step.

    logits = prefill(model, prompt_ids, cache)        # writes the prompt's K/V
    for token, stats in generate(model, prompt_ids, cache, ...):  # streams tokens
        ...

The engine knows nothing about text; callers tokenize and detokenize.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from minillama.kv.cache import KVCache
from minillama.model.llama import Llama
from minillama.model.sampling import SamplingParams, sample


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.generated_tokens / self.decode_s if self.decode_s else float("nan")

    def summary(self) -> str:
        return (f"prompt {self.prompt_tokens} tokens, {self.prefill_tokens_per_s:.1f} tok/s prefill | "
                f"generated {self.generated_tokens} tokens, {self.decode_tokens_per_s:.1f} tok/s decode")


@torch.inference_mode()
def prefill(model: Llama, tokens: list[int], cache: KVCache, chunk: int = 512) -> torch.Tensor:
    """Run prompt tokens through the model in chunks, writing their K/V; returns the last logits (V,)."""
    if not tokens:
        raise ValueError("prefill needs at least one token")
    ids = torch.tensor([tokens], device=model.device)  # (1, T)
    logits = None
    for s in range(0, ids.shape[1], chunk):
        logits = model(ids[:, s : s + chunk], cache, last_only=True)  # (1, 1, V)
    return logits[0, -1].float()


@torch.inference_mode()
def decode_step(model: Llama, token: int, cache: KVCache) -> torch.Tensor:
    """One token through the model, reading the cache; returns its logits (V,)."""
    ids = torch.tensor([[token]], device=model.device)  # (1, 1)
    return model(ids, cache)[0, -1].float()


def generate(model: Llama, prompt: list[int], cache: KVCache, max_new_tokens: int, params: SamplingParams,
             stop_ids: set[int] = frozenset(), generator: torch.Generator | None = None,
             prefill_chunk: int = 512, history: list[int] | None = None) -> Iterator[tuple[int, GenerationStats]]:
    """Prefill ``prompt`` (the tokens not yet in the cache) and yield sampled tokens with running stats.

    Stops after a stop token (which is yielded but not fed back) or max_new_tokens.
    ``history`` (tokens already in the cache) only feeds the repeat penalty.
    """
    stats = GenerationStats(prompt_tokens=len(prompt))
    t0 = time.perf_counter()
    logits = prefill(model, prompt, cache, prefill_chunk)
    stats.prefill_s = time.perf_counter() - t0
    seen = list(history or []) + list(prompt)
    for i in range(max_new_tokens):
        token = sample(logits, params, generator, seen)
        seen.append(token)
        stats.generated_tokens += 1
        if token in stop_ids or i == max_new_tokens - 1:
            yield token, stats
            return
        t0 = time.perf_counter()
        logits = decode_step(model, token, cache)
        stats.decode_s += time.perf_counter() - t0
        yield token, stats
