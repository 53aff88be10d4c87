"""Prompt caches: save a prompt's KV cache to a file and reuse it in another process.

As llama.cpp's ``--prompt-cache`` and mlx-lm's ``save_prompt_cache`` / ``load_prompt_cache``,
but the file (kv/file.py) is the packed cache itself, checked before it is trusted:

    save_prompt_cache(lm, cache, tokens, "doc.kv", logits)    # after prefilling `tokens`
    saved = load_prompt_cache(lm, "doc.kv", "hadv2")          # the cache, its tokens, the last logits
    cache, reused, logits = reuse_prefix(saved, prompt_ids)   # keep the longest common prefix

or all of it in one object, as ``minillama generate --prompt-cache doc.kv`` runs it:

    run = Completion(lm, prompt_ids, parse_kv("hadv2"), GenerateOptions(64), prompt_cache="doc.kv")
    for token, stats in run:   # prefills what the file did not hold; saves the file at the end
        ...

A file matches when it was made by the same model (config, a fingerprint of the weights,
their dtype) with the same ``--kv`` spec; anything else is refused with one line, and the
caller prefills from scratch.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from minillama.kv.cache import ContextFullError, KVCache
from minillama.kv.file import CacheFileError, SavedCache, check_replaceable, encode, read, restore, save, write_atomic
from minillama.kv.spec import KVSpec
from minillama.model.generate import GenerateOptions, GenerationStats, generate, prefill
from minillama.model.loader import LoadedModel


def model_identity(lm: LoadedModel) -> dict:
    """What a cache file must match: the config, a fingerprint of the weights (the first and last
    values of every tensor, as float32, with names and shapes: cheap, and different for any two
    checkpoints that differ anywhere near those), and the weights' dtype."""
    h = hashlib.sha256()
    for name, p in sorted(lm.model.state_dict().items()):
        flat = p.detach().reshape(-1)
        sample = torch.cat([flat[:64], flat[-64:]]).float().cpu()
        h.update(f"{name}{tuple(p.shape)}".encode())
        h.update(sample.numpy().tobytes())
    config = json.dumps(lm.config.__dict__, sort_keys=True, default=str)
    return {"name": lm.name, "config": config, "fingerprint": h.hexdigest()[:32], "dtype": str(lm.model.dtype)}


def save_prompt_cache(
    lm: LoadedModel,
    cache: KVCache,
    tokens: list[int],
    path: str | Path,
    logits: torch.Tensor | None = None,
    extra: dict | None = None,
) -> int:
    """Write the cache (fed `tokens`; `logits` of the last one) atomically; returns the file's bytes.
    Only a missing file or a minillama cache file is replaced (kv/file.py: check_replaceable)."""
    return save(cache, path, tokens, model_identity(lm), logits, extra)


def encode_prompt_cache(
    lm: LoadedModel, cache: KVCache, tokens: list[int], logits: torch.Tensor | None = None, extra: dict | None = None
) -> bytes:
    """The file's bytes, to be written later with kv/file.py's ``write_atomic`` (generate encodes
    the prompt's cache after the prefill and writes it only when the run completes)."""
    return encode(cache, tokens, model_identity(lm), logits, extra)


@dataclass
class PromptCache:
    cache: KVCache
    tokens: list[int]  # every token the cache was fed, in order
    logits: torch.Tensor | None  # (V,) the last token's logits, when saved
    extra: dict
    file_bytes: int


def load_prompt_cache(
    lm: LoadedModel,
    path: str | Path | SavedCache,
    kv: str | None = None,
    capacity: int | None = None,
    on_full: str = "evict",
) -> PromptCache:
    """The saved cache, checked whole (kv/file.py: read) and against this model and (when given)
    the ``--kv`` spec asked for; CacheFileError with the reason when it cannot be used. `path` may
    be a file already read."""
    saved: SavedCache = path if isinstance(path, SavedCache) else read(path)
    cache = restore(saved, model_identity(lm), kv, capacity, lm.model.device, on_full)
    tokens = saved.tokens
    if tokens and max(tokens) >= lm.config.vocab_size or min(tokens, default=0) < 0:
        raise CacheFileError(f"{saved.path} holds token ids outside this model's vocabulary")
    logits = saved.logits
    if logits is not None and logits.shape != (lm.config.vocab_size,):
        raise CacheFileError(f"{saved.path} holds logits of another vocabulary size")
    return PromptCache(cache, tokens, logits, saved.extra, saved.file_bytes)


def keep_common_prefix(cache: KVCache, cached: list[int], prompt: list[int]) -> int:
    """Cut `cache` (fed the tokens `cached`) back to the longest prefix it shares with `prompt`, leaving
    at least one prompt token to feed (its logits start the generation); returns how many tokens it
    keeps. A prefix that ends inside a quantized per-channel key group (KIVI) is cut back to the
    group's start, since a group's scales cover all its tokens; a prefix that reaches into tokens
    the ring evicted cannot be kept at all (the cache restarts empty). Used by generate's prompt
    cache and by every chat turn."""
    common = 0
    for a, b in zip(cached, prompt):
        if a != b:
            break
        common += 1
    common = min(common, len(prompt) - 1)
    return cache.truncate(common) if common < len(cached) else common


def reuse_prefix(saved: PromptCache, prompt: list[int]) -> tuple[KVCache, int, torch.Tensor | None]:
    """Keep the longest common prefix of the saved tokens and `prompt`: returns the cache (cut to it),
    how many prompt tokens it already holds, and the logits to sample from when it holds them all
    (an exact match of a saved prompt resumes bit for bit: its last logits were saved with it).
    The caller prefills the rest."""
    cache, tokens = saved.cache, saved.tokens
    if prompt == tokens and saved.logits is not None and cache.batch == 1:
        return cache, len(prompt), saved.logits
    return cache, keep_common_prefix(cache, tokens, prompt), None


@dataclass
class Resumed:
    """Where a run over `prompt` starts: its cache, how many prompt tokens it already holds, the
    logits to sample from when it holds them all, and one line for the user saying what happened."""

    cache: KVCache
    reused: int
    logits: torch.Tensor | None
    note: str | None


def resume(
    lm: LoadedModel,
    path: str | Path | None,
    spec: KVSpec,
    prompt: list[int],
    capacity: int | None = None,
    on_full: str = "evict",
) -> Resumed:
    """Start a run over `prompt` from the prompt cache at `path` (None: no file) when it was made by
    this model with this spec -- the longest common prefix is kept -- and from an empty cache
    otherwise, with a note saying why the file was not used (damaged, another model, dtype or spec).
    The file itself is never written here."""

    def fresh(note: str | None) -> Resumed:
        return Resumed(
            KVCache.for_model(lm.config, spec, capacity, device=lm.model.device, on_full=on_full), 0, None, note
        )

    if path is None or not Path(path).exists():
        return fresh(None)
    t0 = time.perf_counter()
    try:
        saved = load_prompt_cache(lm, path, str(spec), capacity, on_full)
    except CacheFileError as e:
        return fresh(f"prompt cache not used: {e}")
    cache, reused, logits = reuse_prefix(saved, prompt)
    note = f"prompt cache: reused {reused} of {len(prompt)} prompt tokens, loaded in {time.perf_counter() - t0:.2f} s"
    return Resumed(cache, reused, logits, note)


class Completion:
    """A prompt through to its sampled tokens, started from a prompt cache file when one matches and
    saved to it for the next run: what ``minillama generate --prompt-cache FILE`` runs, for Python.

    Made, it has looked at the file (``note`` says what it gave: None without a file, or why the
    file was not used) and holds ``cache`` and ``reused`` (prompt tokens the cache already holds).
    Iterated, it prefills the rest (``prefill_s``) and yields ``generate``'s (token, stats). When the
    iteration ends -- the tokens are all sampled, a stop token came, or the cache filled up
    (``ContextFullError``, raised after the save) -- the file is replaced atomically by the prompt's
    cache as it was after the prefill, unless ``read_only`` or the file already held the whole
    prompt. A run stopped early (an error, Ctrl-C, a ``break``) leaves the file as it was. Only a
    missing file or a minillama cache file is ever replaced (``check_replaceable``)."""

    def __init__(
        self,
        lm: LoadedModel,
        prompt: list[int],
        spec: KVSpec,
        options: GenerateOptions | None = None,
        *,
        capacity: int | None = None,
        on_full: str = "evict",
        prompt_cache: str | Path | None = None,
        read_only: bool = False,
    ):
        if not prompt:
            raise ValueError("a completion needs at least one prompt token")
        self.save_to = None if read_only else prompt_cache
        if self.save_to:
            check_replaceable(self.save_to)
        self.lm, self.prompt, self.options = lm, prompt, options or GenerateOptions()
        start = resume(lm, prompt_cache, spec, prompt, capacity, on_full)
        self.cache, self.reused, self.note, self._logits = start.cache, start.reused, start.note, start.logits
        self.prefill_s = 0.0

    def __iter__(self) -> Iterator[tuple[int, GenerationStats]]:
        model, logits, t0 = self.lm.model, self._logits, time.perf_counter()
        if logits is None:
            logits = prefill(model, self.prompt[self.reused :], self.cache, self.options.prefill_chunk)[0]  # (V,)
        self.prefill_s = time.perf_counter() - t0
        pending = (  # the prompt's cache, written only once the run completes
            encode_prompt_cache(self.lm, self.cache, self.prompt, logits)
            if self.save_to and self.reused < len(self.prompt)
            else None
        )
        full = None
        try:
            yield from generate(model, self.prompt, self.cache, self.options, held=len(self.prompt), logits=logits)
        except ContextFullError as e:  # the run completed at the cache's end: saved, then raised
            full = e
        if pending:
            write_atomic(self.save_to, pending)
        if full is not None:
            raise full
