"""``minillama generate``: raw completion of a prompt, streamed; optionally through a prompt cache file."""

from __future__ import annotations

import sys
import time

import click
import torch

from minillama.app.options import DTYPES, load, model_options, read_text_file
from minillama.errors import UserError


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The PROMPT argument, or the text of --prompt-file (``-`` reads standard input)."""
    if (prompt is None) == (prompt_file is None):
        raise UserError("give a PROMPT or --prompt-file FILE (- for standard input), one of the two")
    if prompt_file == "-":
        return sys.stdin.read()
    return prompt if prompt_file is None else read_text_file(prompt_file)


@click.command()
@click.argument("prompt", required=False)
@click.option("--prompt-file", default=None, help="Read the prompt from a UTF-8 file (- for standard input).")
@model_options()
@click.option("--max-tokens", default=128, show_default=True, type=click.IntRange(1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0), help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(0), help="0 = off.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--dtype", default="float32", show_default=True, type=DTYPES)
@click.option("--kv", "kv", default="fp32", show_default=True, help="KV cache spec (see `minillama kv --list`).")
@click.option("--ctx", default=None, type=click.IntRange(1), help="Cache capacity in tokens (default: model max).")
@click.option("--prompt-cache", default=None,
              help="A cache file: reuse its longest common prefix with the prompt when it matches the model and "
                   "--kv, and write the prompt's cache to it (atomically, when the run completes).")
@click.option("--raw-special", is_flag=True, help="Parse special-token strings in PROMPT as control tokens.")
def generate(prompt, prompt_file, model_name, device, backend, max_tokens, temperature, top_k, top_p, seed, dtype, kv,
             ctx, prompt_cache, raw_special):
    """Raw completion of PROMPT, streamed to stdout; stats on stderr.

    \b
    Examples:
      minillama generate "The capital of France is" --max-tokens 20
      minillama generate "Once upon a time" --temperature 0.8 --top-p 0.9 --kv hadv2
      minillama generate --prompt-file doc.txt --kv hadv2 --prompt-cache doc.kv   # the second run reuses doc.kv
    """
    from pathlib import Path

    from minillama.kv.cache import KVCache
    from minillama.kv.file import CacheFileError
    from minillama.kv.spec import parse_kv
    from minillama.model.generate import generate as run
    from minillama.model.generate import prefill
    from minillama.model.prompt_cache import load_prompt_cache, reuse_prefix, save_prompt_cache
    from minillama.model.sampling import SamplingParams
    from minillama.model.tokenizer import StreamDecoder

    text = read_prompt(prompt, prompt_file)
    spec = parse_kv(kv)
    lm = load(model_name, dtype, device, backend)
    tok = lm.tokenizer
    ids = tok.encode_with_specials(text) if raw_special else tok.encode(text)
    if tok.add_bos and tok.bos_id is not None:
        ids = [tok.bos_id] + ids
    if not ids:
        raise UserError("the prompt is empty: give some text to complete")
    cache, reused, logits, note = None, 0, None, ""
    if prompt_cache and Path(prompt_cache).exists():
        t0 = time.perf_counter()
        try:
            cache, reused, logits = reuse_prefix(load_prompt_cache(lm, prompt_cache, kv, ctx), ids)
            note = f"prompt cache: reused {reused} of {len(ids)} prompt tokens, loaded in {time.perf_counter() - t0:.2f} s"
        except CacheFileError as e:
            click.echo(f"prompt cache not used: {e}; prefilling the whole prompt", err=True)
    if cache is None:
        cache = KVCache.for_model(lm.config, spec, ctx, device=device)
    t0 = time.perf_counter()
    if logits is None:
        logits = prefill(lm.model, ids[reused:], cache)[0]  # (V,)
    prefill_s = time.perf_counter() - t0
    pending = None
    if prompt_cache and reused < len(ids):  # the prompt's cache, renamed into place when the run completes
        pending = Path(prompt_cache).with_name(f".{Path(prompt_cache).name}.partial")
        save_prompt_cache(lm, cache, ids, pending, logits)
    try:
        stream = StreamDecoder(tok)
        stats = None
        for token, stats in run(lm.model, [], cache, max_tokens, SamplingParams(temperature, top_k, top_p), set(),
                                torch.Generator(device).manual_seed(seed), history=ids, logits=logits):
            click.echo(stream.push(token), nl=False)
        click.echo(stream.flush())
        if pending:
            pending.replace(prompt_cache)
            pending = None
    finally:
        if pending:
            pending.unlink(missing_ok=True)
    new = len(ids) - reused
    click.echo((note + " | " if note else "") + f"prompt {len(ids)} tokens, prefilled {new} at "
               f"{new / prefill_s if new and prefill_s else float('nan'):.1f} tok/s | generated {stats.generated_tokens} "
               f"tokens, {stats.decode_tokens_per_s:.1f} tok/s decode", err=True)
