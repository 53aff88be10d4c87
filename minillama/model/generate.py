"""Generation as plain functions: prefill a prompt into the cache, then decode step by step.

    logits = prefill(model, prompt_ids, cache)        # writes the prompt's K/V, chunk by chunk
    for token, stats in generate(model, prompt_ids, cache, ...):  # streams tokens
        ...

The engine knows nothing about text; callers tokenize and detokenize.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from minillama.kv.interface import Cache
from minillama.model.llama import Llama
from minillama.model.sampling import SamplingParams, sample

PREFILL_CHUNK = 512  # tokens per prefill chunk: each chunk attends over the stored (compressed) past


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
        return (
            f"prompt {self.prompt_tokens} tokens, {self.prefill_tokens_per_s:.1f} tok/s prefill | "
            f"generated {self.generated_tokens} tokens, {self.decode_tokens_per_s:.1f} tok/s decode"
        )


@torch.inference_mode()
def prefill(
    model: Llama,
    tokens: list[int] | torch.Tensor,
    cache: Cache,
    chunk: int = PREFILL_CHUNK,
    progress: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Run prompt tokens (a list for one sequence, or (B, T) ids for B) through the model in chunks,
    writing their K/V; each chunk reads the past as the cache stores it. Returns the logits of
    each sequence's last token (B, V), float32. `progress` is told the tokens of each chunk done
    (B x chunk), for the progress bars of long jobs.

    Every prompt goes through here: generation, chat turns, perplexity windows, needle prompts, bench."""
    ids = tokens if isinstance(tokens, torch.Tensor) else torch.tensor([tokens])  # (B, T)
    if ids.numel() == 0:
        raise ValueError("prefill needs at least one token")
    ids = ids.to(model.device)
    for s in range(0, ids.shape[1], chunk):
        piece = ids[:, s : s + chunk]  # (B, <= chunk)
        logits = model(piece, cache, last_only=True)  # (B, 1, V)
        if progress:
            progress(piece.numel())
    return logits[:, -1].float()


@torch.inference_mode()
def decode_step(model: Llama, token: int, cache: Cache) -> torch.Tensor:
    """One token through the model, reading the cache; returns its logits (V,)."""
    ids = torch.tensor([[token]], device=model.device)  # (1, 1)
    return model(ids, cache)[0, -1].float()


def generate(
    model: Llama,
    prompt: list[int],
    cache: Cache,
    max_new_tokens: int,
    params: SamplingParams,
    stop_ids: set[int] = frozenset(),
    generator: torch.Generator | None = None,
    prefill_chunk: int = PREFILL_CHUNK,
    history: list[int] | None = None,
    logits: torch.Tensor | None = None,
) -> Iterator[tuple[int, GenerationStats]]:
    """Prefill ``prompt`` (the tokens not yet in the cache) and yield sampled tokens with running stats.

    Stops after a stop token (which is yielded but not fed back) or max_new_tokens.
    ``history`` (tokens already in the cache) only feeds the repeat penalty. ``logits`` (V,): the
    cache already holds the whole prompt (``prompt`` is empty) and these are its last token's
    logits, as a resumed prompt cache gives them.
    """
    stats = GenerationStats(prompt_tokens=len(prompt))
    t0 = time.perf_counter()
    if logits is None:
        logits = prefill(model, prompt, cache, prefill_chunk)[0]  # (V,)
    elif prompt:
        raise ValueError("give either prompt tokens to prefill or the logits of a prompt already cached")
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
