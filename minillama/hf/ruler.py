"""The cached-path ruler (eval/perplexity.py) on any transformers model: prefill P tokens, then
every token decoded one at a time over the cache as stored (teacher-forced), scored by NLL,
and against the exact model (one forward, no cache) by KL divergence and top-1 agreement.

The caches compared: minillama's (cache.py: any --kv spec a foreign model can take) and
transformers' own ``QuantizedCache`` with the quanto backend (``hf-quanto4``, ``hf-quanto2``:
group 32, residual 32, as its documentation runs it; needs ``optimum-quanto``), so both are read
by the same ruler in one run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from minillama.errors import UserError
from minillama.eval.perplexity import CachedScores, PplResult, check_window, kl_and_top1, make_windows, token_nll
from minillama.hf.cache import MinillamaCache, minillama_cache

QUANTO = {"hf-quanto4": 4, "hf-quanto2": 2}  # transformers' QuantizedCache rows, by name


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
    """The cache a row names: transformers' quanto cache, or minillama's for a --kv spec."""
    if name in QUANTO:
        from transformers import QuantizedCache

        try:
            return QuantizedCache("quanto", model.config, nbits=QUANTO[name], q_group_size=32, residual_length=32)
        except ImportError:
            raise UserError(f"--kv {name} is transformers' quanto cache: pip install optimum-quanto") from None
    from minillama.kv.spec import parse_kv

    return minillama_cache(model.config, parse_kv(name), capacity)


def first_device(model) -> torch.device:
    """Where a model's inputs go (the embedding's device, under device_map="auto" too)."""
    return model.get_input_embeddings().weight.device


@torch.inference_mode()
def hf_scores(model, seq: torch.Tensor, first: int, cache, exact: torch.Tensor, on_step=None) -> CachedScores:
    """seq (W, L): prefill seq[:, :first] into `cache`, then feed the rest one token at a time; each
    prediction scored against the target and the exact logits `exact` (W, L-1, V)."""
    logits = model(seq[:, :first], past_key_values=cache, use_cache=True).logits[:, -1:]  # (W, 1, V)
    nll, kld, top1 = [], [], []
    decode_s = 0.0
    for at in range(first - 1, seq.shape[1]):  # every token is fed, as minillama's ruler feeds them
        if at >= first:
            t0 = time.perf_counter()
            logits = model(seq[:, at : at + 1], past_key_values=cache, use_cache=True).logits  # (W, 1, V)
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
    """The cached-path table of each cache named in `names` (--kv specs, hf-quanto4/2) on the same
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
        summary, ours = scores.summary(), isinstance(cache, MinillamaCache)
        results.append(
            PplResult(
                kv=name,
                **summary,
                ppl_blind=blind,
                delta_pct=100 * (summary["ppl"] / results[0].ppl - 1) if results else 0.0,
                bits_per_element=cache.bits_per_element() if ours else float("nan"),
                cache_bytes=cache.live_bytes() if ours else 0,
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
