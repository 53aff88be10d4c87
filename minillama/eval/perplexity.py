"""Cached-path perplexity, KL divergence and top-1 agreement: the evaluation that can see the KV cache.

A single forward pass with no cache never reads the compressed cache, so it scores
every KV scheme the same ("blind" perplexity). The cached path prefills P tokens (in
chunks that read the stored past), then decodes the rest one token at a time with
teacher forcing, so every prediction attends over the cache as stored (quantized past +
exact residual). We compute both and print them side by side.

Against the exact model on the same tokens (one no-cache forward: its final hidden
states are kept, 576 floats per token, and turned into logits one step at a time) each
scored token also gets KL(p_exact || p_cached) and whether both models' top-1 predictions
agree, as llama.cpp's ``llama-perplexity --kl-divergence`` reports them: perplexity
averages errors away, KLD does not.

Windows: W consecutive, non-overlapping windows of N tokens starting at token O, run
as one batch of W through a batch-W cache; the S schemes of a run are rows of that batch too
(S x W rows, one cache per scheme: kv/group.py), so each step reads the weights once for all.
Each window scores its tokens P..N-1; the reported perplexity is exp(mean NLL) over all
scored tokens of all windows. If the tokenizer adds a BOS by default, each window gets it
prepended as an unscored token.

Streaming (``ctx`` below the window): the cache holds ``ctx`` tokens and the ring evicts
the oldest non-sink tokens, StreamingLLM-style, so a window can be longer than the
model's context. There is no exact model to compare with then (it would attend to
tokens the cache dropped), so blind perplexity and KLD are left out; perplexity per
``bucket`` of positions shows what happens as positions pass the trained range.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from minillama.errors import UsageError, UserError
from minillama.kv.cache import KVCache
from minillama.kv.group import CacheGroup
from minillama.kv.interface import Cache
from minillama.kv.spec import KVSpec
from minillama.model.auto import choose_codecs
from minillama.model.generate import prefill
from minillama.model.loader import LoadedModel


@dataclass
class PplResult:
    kv: str
    ppl: float
    ppl_sem: float  # its standard error: ppl x the standard error of the mean NLL (as llama-perplexity)
    ppl_blind: float | None
    delta_pct: float
    kld_mean: float | None  # mean over scored tokens of KL(p_exact || p_cached), nats
    kld_p99: float | None  # its 99th percentile
    top1_agree: float | None  # share of scored tokens whose top-1 equals the exact model's
    bits_per_element: float
    cache_bytes: int
    tokens_scored: int
    decode_tokens_per_s: float
    model: str
    tokens: int
    prefill: int
    windows: int
    dtype: str
    ctx: int | None  # cache capacity when it is below the window (streaming), else None
    evicted: int  # tokens the ring evicted per sequence by the end
    buckets: list[dict] = field(default_factory=list)  # per bucket of positions: start, end, ppl, evicted

    def to_dict(self) -> dict:
        return asdict(self)


def make_windows(ids: list[int], n: int, windows: int, offset: int, bos: int | None) -> torch.Tensor:
    """(W, N) windows of the token stream, with a BOS column in front when given -> (W, N+1)."""
    need = offset + n * windows
    if len(ids) < need:
        raise UserError(
            f"the text has {len(ids)} tokens, fewer than the {need} needed for {windows} window(s) of {n} "
            f"tokens from offset {offset}: use a longer text or fewer/shorter windows"
        )
    batch = torch.tensor(ids[offset:need]).view(windows, n)  # (W, N)
    if bos is not None:
        batch = torch.cat([torch.full((windows, 1), bos), batch], dim=1)  # (W, N+1)
    return batch


def check_window(n: int, prefill: int, chunk: int = 1, ctx: int | None = None, bucket: int | None = None) -> None:
    """Window arguments that cannot work: one clear error before anything is loaded."""
    if n < 2:
        raise UsageError(f"--tokens must be at least 2 (a prefill and a scored token), got {n}")
    if prefill < 1 or prefill >= n:
        raise UsageError(f"--prefill must be at least 1 and below --tokens ({n}), got {prefill}")
    if chunk < 1:
        raise UsageError("--chunk must be at least 1")
    if ctx is not None and ctx < 2:
        raise UsageError(f"--ctx must be at least 2 tokens, got {ctx}")
    if bucket is not None and bucket < 1:
        raise UsageError(f"--bucket must be at least 1 token, got {bucket}")
    if ctx is not None and ctx < n and chunk > 1:
        raise UsageError("--chunk needs the window to fit the cache: drop --chunk or raise --ctx")


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits (W, T, V), targets (W, T) -> NLL per token (W, T), in float32."""
    return F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")


def kl_and_top1(exact_logits: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(p_exact || p) per token and top-1 agreement, for logits (W, T, V) -> (W, T) each.

    In float64: two float32 runs of the same model differ by ~1e-6 in their logits, and a
    float32 log-softmax would add noise of that size to a divergence that is ~1e-10."""
    logp_exact = torch.log_softmax(exact_logits.double(), dim=-1)
    logp = torch.log_softmax(logits.double(), dim=-1)
    kld = (logp_exact.exp() * (logp_exact - logp)).sum(-1).clamp_min(0.0)  # rounding can dip below 0
    return kld.float(), exact_logits.argmax(-1) == logits.argmax(-1)


@torch.inference_mode()
def nll_from_hidden(model, hidden: torch.Tensor, targets: torch.Tensor, block: int = 256) -> torch.Tensor:
    """NLL of targets (W, T) under hidden states (W, T, hidden), logits made `block` positions at a time."""
    return torch.cat(
        [
            token_nll(model.lm_head(hidden[:, s : s + block]), targets[:, s : s + block])
            for s in range(0, targets.shape[1], block)
        ],
        dim=1,
    )


@torch.inference_mode()
def blind_nll(model, seq: torch.Tensor, first: int, cache: Cache | None = None) -> torch.Tensor:
    """One forward over each window (no past to read): NLL of targets seq[:, first:], (W, L-first)."""
    if cache is not None and cache.choosing:  # bits=auto chooses from the window's queries, as a prefill does
        choose_codecs(model, seq[:, :-1], cache, model.cache_writer())
    hidden = model.hidden(seq[:, :-1], cache)  # (W, L-1, hidden); a cache here is written, never read
    return nll_from_hidden(model, hidden[:, first - 1 :], seq[:, first:])


@dataclass
class CachedScores:
    """Per scored token (W, L-first): NLL, and against the exact model KLD and top-1 agreement."""

    nll: torch.Tensor
    kld: torch.Tensor | None
    top1: torch.Tensor | None
    evicted: list[int]  # the cache's evicted count after each scored token's step
    decode_s: float

    def summary(self) -> dict:
        """The PplResult fields these scores give: ppl and its standard error (ppl x the SEM of the
        NLL, as llama-perplexity), KLD mean and 99th percentile, top-1 agreement, tokens scored."""
        nll = self.nll.double().flatten()
        ppl = math.exp(float(nll.mean()))
        sem = float(nll.std() / math.sqrt(nll.numel())) if nll.numel() > 1 else float("nan")
        kld = self.kld is not None
        return {
            "ppl": ppl,
            "ppl_sem": ppl * sem,
            "kld_mean": float(self.kld.mean()) if kld else None,
            "kld_p99": float(torch.quantile(self.kld.flatten().double(), 0.99)) if kld else None,
            "top1_agree": float(self.top1.float().mean()) if self.top1 is not None else None,
            "tokens_scored": int(nll.numel()),
        }

    def rows(self, rows: slice, share: int) -> CachedScores:
        """The scores of some batch rows: one scheme of a batch of `share` schemes, which the
        decode time is split between (each row costs the same)."""
        kld = self.kld[rows] if self.kld is not None else None
        top1 = self.top1[rows] if self.top1 is not None else None
        return CachedScores(self.nll[rows], kld, top1, self.evicted, self.decode_s / share)


@torch.inference_mode()
def cached_scores(
    model,
    seq: torch.Tensor,
    first: int,
    cache: KVCache,
    chunk: int = 1,
    exact_hidden: torch.Tensor | None = None,
    on_step: Callable[[int], None] | None = None,
) -> CachedScores:
    """Prefill seq[:, :first] in chunks, then feed the rest `chunk` tokens at a time (teacher forcing).

    ``exact_hidden`` (W, L-1, hidden), the exact model's final hidden states at every position,
    turns on KLD and top-1 agreement against it; with seq of S x W rows (S schemes as one batch)
    each scheme's rows are compared with the same W.
    """
    logits = prefill(model, seq[:, :first], cache)[:, None]  # (W, 1, V): in chunks, each reading the stored past
    nll, kld, top1, evicted = [], [], [], []

    def score(logits: torch.Tensor, at: int) -> None:  # logits (W, k, V) predict seq[:, at + 1 : at + 1 + k]
        targets = seq[:, at + 1 : at + 1 + logits.shape[1]]
        logits = logits[:, : targets.shape[1]]
        if not targets.shape[1]:
            return
        nll.append(token_nll(logits, targets))
        if exact_hidden is not None:  # its rows once; a batch of S schemes x W windows repeats them S times
            exact_logits = model.lm_head(exact_hidden[:, at : at + targets.shape[1]])  # (W, k, V)
            k, t = kl_and_top1(exact_logits.repeat(logits.shape[0] // exact_logits.shape[0], 1, 1), logits)
            kld.append(k)
            top1.append(t)
        evicted.extend([cache.evicted] * targets.shape[1])

    score(logits, first - 1)
    decode_s = 0.0
    length = seq.shape[1]
    for i in range(first, length, chunk):
        t0 = time.perf_counter()
        logits = model(seq[:, i : i + chunk], cache)  # (W, k, V): the last one predicts past the end
        decode_s += time.perf_counter() - t0
        score(logits, i)
        if on_step:
            on_step(logits.shape[1])
    return CachedScores(
        torch.cat(nll, dim=1),
        torch.cat(kld, dim=1) if kld else None,
        torch.cat(top1, dim=1) if top1 else None,
        evicted,
        decode_s,
    )


def bucket_rows(nll: torch.Tensor, evicted: list[int], first: int, bucket: int) -> list[dict]:
    """Perplexity per bucket of `bucket` positions: the scored target at column c sits at position first + c."""
    rows = []
    positions = first + torch.arange(nll.shape[1])
    for start in range(0, int(positions[-1]) + 1, bucket):
        cols = ((positions >= start) & (positions < start + bucket)).nonzero().flatten()
        if len(cols):
            rows.append(
                {
                    "start": start,
                    "end": start + bucket,
                    "ppl": math.exp(float(nll[:, cols].mean())),
                    "evicted": evicted[int(cols[-1])],
                }
            )
    return rows


def evaluate(
    lm: LoadedModel,
    ids: list[int],
    specs: list[KVSpec],
    n: int = 896,
    prefill: int = 128,
    offset: int = 0,
    windows: int = 1,
    chunk: int = 1,
    blind: bool = True,
    dtype: str = "float32",
    progress: Callable[[str, int], Callable[[int], None]] | None = None,
    ctx: int | None = None,
    bucket: int | None = None,
) -> list[PplResult]:
    """Cached-path perplexity (and blind perplexity, KLD, top-1 agreement) of each KV scheme on the same windows.

    ``ctx`` caps the cache below the window (the ring evicts; streaming); ``bucket`` adds
    perplexity per bucket of that many positions.
    """
    check_window(n, prefill, chunk, ctx, bucket)
    tok = lm.tokenizer
    bos = tok.bos_id if tok.add_bos else None
    seq = make_windows(ids, n, windows, offset, bos).to(lm.model.device)  # (W, L)
    first = prefill + (bos is not None)  # index of the first scored token
    streaming = ctx is not None and ctx < seq.shape[1]
    # The exact model on the same tokens: one no-cache forward, hidden states kept for KLD.
    exact = None if streaming else lm.model.hidden(seq[:, :-1])  # (W, L-1, hidden)
    steps = seq.shape[1] - first
    caches = [
        KVCache.for_model(lm.config, spec, max(ctx or seq.shape[1], spec.min_capacity), windows, lm.model.device)
        for spec in specs
    ]
    if streaming:  # each cache evicts on its own schedule: one scheme at a time
        scored = [
            cached_scores(lm.model, seq, first, cache, chunk, exact, progress(str(spec), steps) if progress else None)
            for spec, cache in zip(specs, caches)
        ]
    else:  # every scheme a row block of one batch: each step reads the weights once for all (kv/group.py)
        group = CacheGroup(caches)
        on_step = progress(f"{len(specs)} scheme(s)", steps) if progress else None
        both = cached_scores(lm.model, seq.repeat(len(specs), 1), first, group, chunk, exact, on_step)
        scored = [both.rows(slice(i * windows, (i + 1) * windows), len(specs)) for i in range(len(specs))]
    results: list[PplResult] = []
    blinds: list[float] = []
    for spec, cache, scores in zip(specs, caches, scored):
        summary = scores.summary()
        ppl_blind = None
        if blind and not streaming:
            blind_cache = KVCache.for_model(lm.config, spec, cache.capacity, batch=windows, device=lm.model.device)
            ppl_blind = math.exp(float(blind_nll(lm.model, seq, first, blind_cache).mean()))
            blinds.append(ppl_blind)
        results.append(
            PplResult(
                kv=str(spec),
                **summary,
                ppl_blind=ppl_blind,
                delta_pct=100 * (summary["ppl"] / results[0].ppl - 1) if results else 0.0,
                bits_per_element=cache.bits_per_element(),
                cache_bytes=sum(cache.live_bytes().values()),
                decode_tokens_per_s=steps * windows / scores.decode_s if scores.decode_s else float("nan"),
                model=lm.name,
                tokens=n,
                prefill=prefill,
                windows=windows,
                dtype=dtype,
                ctx=ctx if streaming else None,
                evicted=cache.evicted,
                buckets=bucket_rows(scores.nll, scores.evicted, first - (bos is not None), bucket) if bucket else [],
            )
        )
    # The point of the blind column: with no past to read, the cache scheme cannot matter.
    assert all(b == blinds[0] for b in blinds), f"blind perplexity differs across schemes: {blinds}"
    return results


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def aligned(table: list[list[str]]) -> list[str]:
    """Rows of cells as lines: the first column left-aligned, the rest right-aligned, each as wide
    as its widest cell and two spaces apart, so no two columns ever run together."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in table
    ]


def format_table(results: list[PplResult], chunk: int = 1) -> str:
    r0 = results[0]
    head = (
        f"cached-path perplexity: {r0.model}, {r0.windows} window(s) x {r0.tokens} tokens, prefill {r0.prefill}, "
        f"{r0.tokens_scored} tokens scored per scheme, evaluation in {r0.dtype}; ± is ppl's standard error "
        "(ppl x the standard error of the mean NLL, as llama-perplexity)"
    )
    if r0.ctx is not None:
        head += (
            f"\nSTREAMING: the cache holds {r0.ctx} tokens and evicted {r0.evicted} per sequence (sinks kept); "
            "no exact model to compare with, so no blind ppl or KLD"
        )
    if chunk > 1:
        head += f"\nAPPROXIMATION: --chunk {chunk} decodes {chunk} tokens per step (each chunk sees its own exact K/V)"
    header = ["kv", "bits/el", "cache MB", "ppl", "±", "Δ%", "KLD mean", "KLD p99", "top-1 %", "blind ppl"]
    table = [header + ["decode tok/s"]]
    for r in results:
        top1 = None if r.top1_agree is None else 100 * r.top1_agree
        table.append(
            [
                r.kv,
                f"{r.bits_per_element:.2f}",
                f"{r.cache_bytes / 1e6:.2f}",
                f"{r.ppl:.4f}",
                f"{r.ppl_sem:.4f}",
                f"{r.delta_pct:+.2f}",
                _num(r.kld_mean, ".5f"),
                _num(r.kld_p99, ".4f"),
                _num(top1, ".2f"),
                _num(r.ppl_blind, ".4f"),
                f"{r.decode_tokens_per_s:.1f}",
            ]
        )
    cols, *rows = aligned(table)
    lines = [head, cols, *rows]
    if r0.buckets:
        lines += [
            "",
            "perplexity per bucket of positions (evicted = tokens the ring had dropped by the bucket's end):",
            f"{'positions':<16}" + "".join(f"{r.kv[:22]:>24}" for r in results),
        ]
        for i, b in enumerate(r0.buckets):
            cells = "".join(f"{r.buckets[i]['ppl']:>14.3f} ({r.buckets[i]['evicted']:>6})" for r in results)
            lines.append(f"{b['start']:>6}-{b['end']:<9}" + cells)
    return "\n".join(lines)
