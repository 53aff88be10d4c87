"""Cached-path perplexity: the evaluation that can see the KV cache.

A single forward pass with no cache never reads the compressed cache, so it scores
every KV scheme the same ("blind" perplexity). The cached path prefills P tokens, then
decodes the rest one token at a time with teacher forcing, so every prediction attends
over the cache as stored (quantized past + exact residual). We compute both and print
them side by side.

Windows: W consecutive, non-overlapping windows of N tokens starting at token O, run
as one batch of W through a batch-W cache. Each window scores its tokens P..N-1; the
reported perplexity is exp(mean NLL) over all scored tokens of all windows. If the
tokenizer adds a BOS by default, each window gets it prepended as an unscored token.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from minillama.kv.cache import KVCache
from minillama.kv.codecs import KVSpec
from minillama.errors import UserError
from minillama.model.loader import LoadedModel


@dataclass
class PplResult:
    kv: str
    ppl: float
    ppl_blind: float | None
    delta_pct: float
    bits_per_element: float
    cache_bytes: int
    tokens_scored: int
    decode_tokens_per_s: float
    model: str
    tokens: int
    prefill: int
    windows: int
    dtype: str

    def to_dict(self) -> dict:
        return asdict(self)


def make_windows(ids: list[int], n: int, windows: int, offset: int, bos: int | None) -> torch.Tensor:
    """(W, N) windows of the token stream, with a BOS column in front when given -> (W, N+1)."""
    need = offset + n * windows
    if len(ids) < need:
        raise UserError(f"the text has {len(ids)} tokens, fewer than the {need} needed for {windows} window(s) of {n} "
                        f"tokens from offset {offset}: use a longer text or fewer/shorter windows")
    batch = torch.tensor(ids[offset:need]).view(windows, n)  # (W, N)
    if bos is not None:
        batch = torch.cat([torch.full((windows, 1), bos), batch], dim=1)  # (W, N+1)
    return batch


def check_window(n: int, prefill: int, chunk: int = 1) -> None:
    """Window arguments that cannot work: one clear error before anything is loaded."""
    if prefill < 1 or prefill >= n:
        raise UserError(f"--prefill must be at least 1 and below --tokens ({n}), got {prefill}")
    if chunk < 1:
        raise UserError("--chunk must be at least 1")


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits (W, T, V), targets (W, T) -> NLL per token (W, T), in float32."""
    return F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")


@torch.inference_mode()
def blind_nll(model, seq: torch.Tensor, first: int, cache: KVCache | None = None) -> torch.Tensor:
    """One forward over each window (no past to read): NLL of targets seq[:, first:], (W, L-first)."""
    logits = model(seq[:, :-1], cache)  # (W, L-1, V); a cache here is written, never read
    return token_nll(logits[:, first - 1 :], seq[:, first:])


@torch.inference_mode()
def cached_nll(model, seq: torch.Tensor, first: int, cache: KVCache, chunk: int = 1,
               on_step: Callable[[int], None] | None = None) -> tuple[torch.Tensor, float]:
    """Prefill seq[:, :first], then feed the rest `chunk` tokens at a time (teacher forcing).

    Returns NLL of targets seq[:, first:] (W, L-first) and the decode seconds.
    """
    logits = model(seq[:, :first], cache, last_only=True)  # (W, 1, V): predicts seq[:, first]
    nll = [token_nll(logits, seq[:, first : first + 1])]
    decode_s = 0.0
    length = seq.shape[1]
    for i in range(first, length, chunk):
        t0 = time.perf_counter()
        logits = model(seq[:, i : i + chunk], cache)  # (W, k, V): the last one predicts past the end
        decode_s += time.perf_counter() - t0
        targets = seq[:, i + 1 : i + 1 + chunk]
        if targets.shape[1]:
            nll.append(token_nll(logits[:, : targets.shape[1]], targets))
        if on_step:
            on_step(min(chunk, length - i))
    return torch.cat(nll, dim=1), decode_s


def evaluate(lm: LoadedModel, ids: list[int], specs: list[KVSpec], n: int = 896, prefill: int = 128,
             offset: int = 0, windows: int = 1, chunk: int = 1, blind: bool = True, dtype: str = "float32",
             progress: Callable[[str, int], Callable[[int], None]] | None = None) -> list[PplResult]:
    """Cached-path (and blind) perplexity of each KV scheme on the same token windows."""
    check_window(n, prefill, chunk)
    tok = lm.tokenizer
    bos = tok.bos_id if tok.add_bos else None
    seq = make_windows(ids, n, windows, offset, bos).to(lm.model.device)  # (W, L)
    first = prefill + (bos is not None)  # index of the first scored token
    results: list[PplResult] = []
    blinds: list[float] = []
    for spec in specs:
        capacity = max(seq.shape[1], spec.sinks + spec.residual + spec.unit)  # never evicts: the window fits
        cache = KVCache.for_model(lm.config, spec, capacity, batch=windows, device=lm.model.device)
        on_step = progress(str(spec), (seq.shape[1] - first) * windows) if progress else None
        nll, decode_s = cached_nll(lm.model, seq, first, cache, chunk, on_step)
        ppl = math.exp(float(nll.mean()))
        ppl_blind = None
        if blind:
            blind_cache = KVCache.for_model(lm.config, spec, capacity, batch=windows, device=lm.model.device)
            ppl_blind = math.exp(float(blind_nll(lm.model, seq, first, blind_cache).mean()))
            blinds.append(ppl_blind)
        steps = seq.shape[1] - first
        results.append(PplResult(
            kv=str(spec), ppl=ppl, ppl_blind=ppl_blind,
            delta_pct=100 * (ppl / results[0].ppl - 1) if results else 0.0,
            bits_per_element=cache.bits_per_element(), cache_bytes=sum(cache.live_bytes().values()),
            tokens_scored=int(nll.numel()), decode_tokens_per_s=steps * windows / decode_s if decode_s else float("nan"),
            model=lm.name, tokens=n, prefill=prefill, windows=windows, dtype=dtype,
        ))
    # The point of the blind column: with no past to read, the cache scheme cannot matter.
    assert all(b == blinds[0] for b in blinds), f"blind perplexity differs across schemes: {blinds}"
    return results


def format_table(results: list[PplResult], chunk: int = 1) -> str:
    r0 = results[0]
    head = (f"cached-path perplexity: {r0.model}, {r0.windows} window(s) x {r0.tokens} tokens, prefill {r0.prefill}, "
            f"{r0.tokens_scored} tokens scored per scheme, evaluation in {r0.dtype}")
    if chunk > 1:
        head += f"\nAPPROXIMATION: --chunk {chunk} decodes {chunk} tokens per step (each chunk sees its own exact K/V)"
    cols = f"{'kv':<34}{'bits/el':>8}{'cache MB':>10}{'ppl':>10}{'Δ%':>8}{'blind ppl':>11}{'decode tok/s':>14}"
    rows = []
    for r in results:
        blind = f"{r.ppl_blind:.4f}" if r.ppl_blind is not None else "-"
        rows.append(f"{r.kv:<34}{r.bits_per_element:>8.2f}{r.cache_bytes / 1e6:>10.2f}{r.ppl:>10.4f}"
                    f"{r.delta_pct:>+8.2f}{blind:>11}{r.decode_tokens_per_s:>14.1f}")
    return "\n".join([head, cols, *rows])
