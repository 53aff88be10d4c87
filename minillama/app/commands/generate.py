"""``minillama generate``: raw completion of a prompt, streamed."""

from __future__ import annotations

import click
import torch

from minillama.app.options import DTYPES, load, model_options
from minillama.errors import UserError


@click.command()
@click.argument("prompt")
@model_options()
@click.option("--max-tokens", default=128, show_default=True, type=click.IntRange(1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0), help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(0), help="0 = off.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--dtype", default="float32", show_default=True, type=DTYPES)
@click.option("--kv", "kv", default="fp32", show_default=True, help="KV cache spec (see `minillama kv --list`).")
@click.option("--ctx", default=None, type=click.IntRange(1), help="Cache capacity in tokens (default: model max).")
@click.option("--raw-special", is_flag=True, help="Parse special-token strings in PROMPT as control tokens.")
def generate(prompt, model_name, device, backend, max_tokens, temperature, top_k, top_p, seed, dtype, kv, ctx, raw_special):
    """Raw completion of PROMPT, streamed to stdout; stats on stderr.

    \b
    Examples:
      minillama generate "The capital of France is" --max-tokens 20
      minillama generate "Once upon a time" --temperature 0.8 --top-p 0.9 --kv hadv2
    """
    from minillama.kv.cache import KVCache
    from minillama.kv.spec import parse_kv
    from minillama.model.generate import generate as run
    from minillama.model.sampling import SamplingParams
    from minillama.model.tokenizer import StreamDecoder

    spec = parse_kv(kv)
    lm = load(model_name, dtype, device, backend)
    tok = lm.tokenizer
    ids = tok.encode_with_specials(prompt) if raw_special else tok.encode(prompt)
    if tok.add_bos and tok.bos_id is not None:
        ids = [tok.bos_id] + ids
    if not ids:
        raise UserError("the prompt is empty: give some text to complete")
    cache = KVCache.for_model(lm.config, spec, ctx, device=device)
    params = SamplingParams(temperature, top_k, top_p)
    stream = StreamDecoder(tok)
    stats = None
    for token, stats in run(lm.model, ids, cache, max_tokens, params, set(),
                            torch.Generator(device).manual_seed(seed)):
        click.echo(stream.push(token), nl=False)
    click.echo(stream.flush())
    click.echo(stats.summary(), err=True)
