"""minillama's rulers on any transformers model, each over the cache as stored:

* ``evaluate_hf`` -- the cached-path perplexity (eval/perplexity.py): prefill P tokens, then every
  token decoded one at a time over the cache (teacher-forced), scored by NLL, and against the
  exact model (one forward, no cache) by KL divergence and top-1 agreement;
* ``needle_hf`` -- needle retrieval (eval/needle.py): the same prompts, prefilled in chunks and
  answered greedily through the cache;
* ``bench_hf`` -- decode tokens/s at a context, with the cache's bytes (and on a GPU the peak
  memory), so a user sees what the compressed cache saves on their model.

The caches compared: minillama's (cache.py: any --kv spec a foreign model can take),
transformers' plain ``DynamicCache`` (``hf-dynamic``) and its ``QuantizedCache`` with the quanto
backend (``hf-quanto4``, ``hf-quanto2``: group 32, residual 32, as its documentation runs it;
needs ``optimum-quanto``), all read by the same ruler in one run.
"""

from __future__ import annotations

import functools
import inspect
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from minillama.errors import UserError
from minillama.eval.needle import Answers, NeedleRow, make_cells, score
from minillama.eval.perplexity import CachedScores, PplResult, check_window, kl_and_top1, make_windows, token_nll
from minillama.hf.cache import MinillamaCache, minillama_cache

QUANTO = {"hf-quanto4": 4, "hf-quanto2": 2}  # transformers' QuantizedCache rows, by name
HF_CACHES = ("hf-dynamic", *QUANTO)  # transformers' own caches, rows beside minillama's
PREFILL_CHUNK = 512  # prompt tokens a forward (bounds the attention scores' memory)


def load_hf(name: str, dtype: str, device: str):
    """(model, tokenizer) from a folder or hub id; device "auto" spreads the model over the GPUs
    (accelerate's device_map="auto"). Hub and device problems end in one line."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but no CUDA GPU is available: use --device cpu")
    where = {"device_map": "auto"} if device == "auto" else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=getattr(torch, dtype), **where)
    except OSError as e:
        local = Path(name).exists()
        why = "not a model folder transformers can read" if local else "not on this disk and the hub is unreachable"
        raise UserError(f"cannot load {name}: {why} ({str(e).splitlines()[0][:120]})") from None
    except ImportError as e:
        raise UserError(f"cannot load {name}: {e}".splitlines()[0]) from None
    if device not in ("auto", "cpu"):
        model = model.to(device)
    return model.eval(), tokenizer


def hf_cache(model, name: str, capacity: int):
    """The cache a row names: transformers' own (plain or quanto), or minillama's for a --kv spec."""
    if name == "hf-dynamic":
        from transformers import DynamicCache

        return DynamicCache(config=model.config)
    if name in QUANTO:
        from transformers import QuantizedCache

        try:
            return QuantizedCache("quanto", model.config, nbits=QUANTO[name], q_group_size=32, residual_length=32)
        except ImportError:
            raise UserError(f"--kv {name} is transformers' quanto cache: pip install optimum-quanto") from None
    from minillama.kv.spec import parse_kv

    return minillama_cache(model.config, parse_kv(name), capacity)


def cache_bytes(cache) -> int:
    """The bytes a cache holds now: minillama's as it counts them (codes, scales, residual, sinks);
    transformers' caches by the tensors their layers keep (quanto's packed codes and scales too)."""
    if isinstance(cache, MinillamaCache):
        return cache.live_bytes()

    def nbytes(t) -> int:
        if hasattr(t, "__tensor_flatten__"):  # a tensor subclass (quanto's): the tensors inside it
            return sum(nbytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
        return t.numel() * t.element_size()

    return sum(nbytes(t) for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor))


def bits_per_element(cache, model) -> float:
    """Stored bits per key or value element: minillama's own count, else the bytes held over the
    elements of the keys and values they stand for."""
    if isinstance(cache, MinillamaCache):
        return cache.bits_per_element()
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    batch = next(t.shape[0] for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor))
    per_token = 2 * len(cache.layers) * text.num_key_value_heads * head_dim
    return 8 * cache_bytes(cache) / (batch * cache.get_seq_length() * per_token)


class HFTokens:
    """A transformers tokenizer as the needle prompts use one (eval/needle.py): text to ids without
    special tokens, the BOS id and whether the model wants it, ids back to text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.bos_id = tokenizer.bos_token_id
        self.add_bos = bool(getattr(tokenizer, "add_bos_token", False)) and self.bos_id is not None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def forward(model, ids: torch.Tensor, cache):
    """One forward of ids (B, T) over `cache`, which reads the past and keeps the new tokens."""
    return model(ids.to(first_device(model)), use_cache=True, **{cache_keyword(type(model)): cache})


@functools.cache
def cache_keyword(model_class) -> str:
    """``cache`` where the model's forward names its cache so (newer transformers), else
    ``past_key_values``: looked up once per model class, not every decode step."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def first_device(model) -> torch.device:
    """Where a model's inputs go (the embedding's device, under device_map="auto" too)."""
    return model.get_input_embeddings().weight.device


@torch.inference_mode()
def hf_scores(model, seq: torch.Tensor, first: int, cache, exact: torch.Tensor, on_step=None) -> CachedScores:
    """seq (W, L): prefill seq[:, :first] into `cache`, then feed the rest one token at a time; each
    prediction scored against the target and the exact logits `exact` (W, L-1, V)."""
    logits = forward(model, seq[:, :first], cache).logits[:, -1:]  # (W, 1, V)
    nll, kld, top1 = [], [], []
    decode_s = 0.0
    for at in range(first - 1, seq.shape[1]):  # every token is fed, as minillama's ruler feeds them
        if at >= first:
            t0 = time.perf_counter()
            logits = forward(model, seq[:, at : at + 1], cache).logits  # (W, 1, V)
            decode_s += time.perf_counter() - t0
            if on_step:
                on_step(1)
        if at + 1 == seq.shape[1]:  # the last token's prediction lies past the window
            break
        logits = logits.float().to(exact.device)
        nll.append(token_nll(logits, seq[:, at + 1 : at + 2].to(exact.device)))
        k, t = kl_and_top1(exact[:, at : at + 1], logits)
        kld.append(k)
        top1.append(t)
    return CachedScores(torch.cat(nll, 1), torch.cat(kld, 1), torch.cat(top1, 1), [], decode_s)


@torch.inference_mode()
def evaluate_hf(
    model,
    model_name: str,
    ids: list[int],
    names: list[str],
    n: int = 896,
    prefill: int = 128,
    offset: int = 0,
    windows: int = 1,
    bos: int | None = None,
    dtype: str = "float32",
    progress: Callable[[str, int], Callable[[int], None]] | None = None,
) -> list[PplResult]:
    """The cached-path table of each cache named in `names` (--kv specs, HF_CACHES) on the same
    windows of a transformers model, the blind (no-cache) perplexity beside it."""
    check_window(n, prefill, 1, None, None)
    device = first_device(model)
    seq = make_windows(ids, n, windows, offset, bos).to(device)  # (W, L)
    first = prefill + (bos is not None)
    exact = model(seq[:, :-1]).logits.float()  # (W, L-1, V): the exact model, no cache
    blind = math.exp(float(token_nll(exact[:, first - 1 :], seq[:, first:].to(exact.device)).mean()))
    steps = seq.shape[1] - first
    results: list[PplResult] = []
    for name in names:
        cache = hf_cache(model, name, seq.shape[1])
        scores = hf_scores(model, seq, first, cache, exact, progress(name, steps) if progress else None)
        summary = scores.summary()
        results.append(
            PplResult(
                kv=name,
                **summary,
                ppl_blind=blind,
                delta_pct=100 * (summary["ppl"] / results[0].ppl - 1) if results else 0.0,
                bits_per_element=bits_per_element(cache, model),
                cache_bytes=cache_bytes(cache),
                decode_tokens_per_s=steps * windows / scores.decode_s if scores.decode_s else float("nan"),
                model=model_name,
                tokens=n,
                prefill=prefill,
                windows=windows,
                dtype=dtype,
                ctx=None,
                evicted=0,
            )
        )
    return results


@torch.inference_mode()
def hf_generate(model, ids: torch.Tensor, cache, max_new: int, progress=None) -> torch.Tensor:
    """Prefill the prompts ids (B, L) through `cache` in chunks, then decode greedily over it: the
    new tokens (B, max_new). `progress` is told the prompt tokens of each chunk."""
    ids = ids.to(first_device(model))
    for at in range(0, ids.shape[1], PREFILL_CHUNK):
        chunk = ids[:, at : at + PREFILL_CHUNK]  # (B, C)
        logits = forward(model, chunk, cache).logits[:, -1]  # (B, V)
        if progress:
            progress(chunk.numel())
    out = []
    for i in range(max_new):
        token = logits.argmax(-1, keepdim=True)  # (B, 1)
        out.append(token)
        if i < max_new - 1:
            logits = forward(model, token, cache).logits[:, -1]  # (B, V)
    return torch.cat(out, dim=1)  # (B, max_new)


def needle_hf(
    model,
    tokenizer,
    names: list[str],
    lengths: list[int],
    depths: list[float],
    trials: int = 1,
    task: str = "passkey",
    haystack: list[str] | None = None,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> list[NeedleRow]:
    """eval/needle.py's retrieval table on a transformers model: the same prompts for every cache
    named in `names` (--kv specs, hf-dynamic, hf-quanto4/2)."""
    tokens = HFTokens(tokenizer)

    def ask(name: str, prompts: list[list[int]], max_new: int) -> Answers:
        cache = hf_cache(model, name, len(prompts[0]) + max_new)
        new = hf_generate(model, torch.tensor(prompts), cache, max_new, progress)  # (B, max_new)
        texts = [tokens.decode(row) for row in new.tolist()]
        return Answers(texts, bits_per_element(cache, model), cache_bytes(cache) // len(prompts))

    return score(names, task, make_cells(tokens, task, lengths, depths, trials, haystack, seed), ask)


@dataclass
class HFBenchRow:
    kv: str
    context: int
    decode_tokens: int
    ms_per_token: float
    tokens_per_s: float
    bits_per_element: float
    cache_bytes: int  # held after the timed steps
    peak_bytes: int | None  # the device's peak allocated memory during the row (a CUDA GPU only)

    def to_dict(self) -> dict:
        return dict(vars(self))


@torch.inference_mode()
def bench_hf(model, ids: list[int], names: list[str], context: int, decode_tokens: int) -> list[HFBenchRow]:
    """Decode speed of each cache at `context` tokens: the text's first `context` tokens
    prefilled, then `decode_tokens` greedy steps timed one by one over the cache as stored."""
    device = first_device(model)
    cuda = device.type == "cuda"
    prompt = torch.tensor([ids[:context]])  # (1, context)
    rows = []
    for name in names:
        cache = hf_cache(model, name, context + decode_tokens)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        token = hf_generate(model, prompt, cache, 1)  # (1, 1): the prefill's next token
        times = []
        for _ in range(decode_tokens):
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            logits = forward(model, token, cache).logits[:, -1]  # (1, V)
            token = logits.argmax(-1, keepdim=True)  # (1, 1)
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        ms = 1000 * statistics.median(times)
        peak = torch.cuda.max_memory_allocated(device) if cuda else None
        rows.append(
            HFBenchRow(
                name, context, decode_tokens, ms, 1000 / ms, bits_per_element(cache, model), cache_bytes(cache), peak
            )
        )
    return rows


def format_bench(rows: list[HFBenchRow], model_name: str) -> str:
    """One line a cache and context: median step, tokens/s, the cache's bytes (and the GPU's peak)."""
    peak = any(r.peak_bytes is not None for r in rows)
    lines = [
        f"decode on {model_name} in transformers, median of the timed steps, one sequence",
        f"{'kv':<24}{'context':>8}{'ms/tok':>9}{'tok/s':>8}{'bits':>7}{'cache MB':>10}" + ("  peak MB" if peak else ""),
    ]
    for r in rows:
        line = f"{r.kv:<24}{r.context:>8}{r.ms_per_token:>9.2f}{r.tokens_per_s:>8.1f}{r.bits_per_element:>7.2f}"
        line += f"{r.cache_bytes / 1e6:>10.2f}" + (f"{r.peak_bytes / 1e6:>9.0f}" if r.peak_bytes is not None else "")
        lines.append(line)
    return "\n".join(lines)
