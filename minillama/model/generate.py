"""Generation as plain functions: prefill a prompt into the cache, then decode step by step.

    options = GenerateOptions(max_new_tokens=64, sampling=SamplingParams(temperature=0.7))
    for token, stats in generate(model, prompt_ids, cache, options):  # prefills, then streams tokens
        ...
    logits = prefill(model, prompt_ids, cache)   # or only write a prompt's K/V, chunk by chunk

The engine knows nothing about text; callers tokenize and detokenize.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

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
    if getattr(cache, "choosing", False):  # bits=auto: the cache chooses its codecs from the first chunk
        from minillama.model.auto import choose_codecs

        choose_codecs(model, ids[:, :chunk], cache, model.cache_writer())
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


@dataclass(frozen=True)
class GenerateOptions:
    """How a generation runs -- the knobs of ``minillama generate``: the most tokens to sample, how
    each is sampled, the tokens that end it (yielded, not fed back), the random source (None:
    torch's global one) and the prefill's chunk size."""

    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    prefill_chunk: int = PREFILL_CHUNK


def generate(
    model: Llama,
    prompt: list[int],
    cache: Cache,
    options: GenerateOptions | None = None,
    *,
    held: int = 0,
    logits: torch.Tensor | None = None,
) -> Iterator[tuple[int, GenerationStats]]:
    """Prefill what `cache` does not hold of ``prompt`` and yield sampled tokens with running stats.

    The cache already holds the first ``held`` tokens of the prompt (a prefix reused from an earlier
    turn or a prompt cache file: they only feed the repeat penalty); the rest are prefilled. When it
    holds the whole prompt, ``logits`` (V,) are its last token's logits, as a resumed prompt cache
    gives them. Stops after a stop token (yielded but not fed back) or ``max_new_tokens``.
    """
    o = options or GenerateOptions()
    if not 0 <= held <= len(prompt):
        raise ValueError(f"held {held} is not within the prompt's {len(prompt)} tokens")
    if (logits is not None) != (held == len(prompt)):
        raise ValueError("logits go with a prompt the cache holds whole (held == len(prompt)), and only then")
    stats = GenerationStats(prompt_tokens=len(prompt) - held)
    t0 = time.perf_counter()
    if logits is None:
        logits = prefill(model, prompt[held:], cache, o.prefill_chunk)[0]  # (V,)
    stats.prefill_s = time.perf_counter() - t0
    seen = list(prompt)
    for i in range(o.max_new_tokens):
        token = sample(logits, o.sampling, o.generator, seen)
        seen.append(token)
        stats.generated_tokens += 1
        if token in o.stop_ids or i == o.max_new_tokens - 1:
            yield token, stats
            return
        t0 = time.perf_counter()
        logits = decode_step(model, token, cache)
        stats.decode_s += time.perf_counter() - t0
        yield token, stats
