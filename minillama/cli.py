"""The ``minillama`` command line: a thin click layer over the library API.

Every command's work is a function in the package; this file only parses options,
prints, and turns errors into one clear line (a traceback only with --debug).
"""

from __future__ import annotations

import sys

import click
import torch

from minillama.errors import UserError


class Main(click.Group):
    """Turns any error into one line on stderr and exit 1, unless --debug is given."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except Exception as e:
            if ctx.params.get("debug") or (ctx.obj or {}).get("debug"):
                raise
            msg = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e} (rerun with --debug for a traceback)"
            click.echo(f"error: {msg}", err=True)
            sys.exit(1)


@click.group(cls=Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.pass_context
def cli(ctx, debug):
    """minillama: a small Llama engine that owns its KV cache.

    \b
    Examples:
      minillama fetch                      # install the offline default model
      minillama generate "Once upon a time" --max-tokens 40
      minillama chat --kv hadv2            # chat with a 4-bit-K / 2-bit-V cache
      minillama ppl --kv fp16 --kv hadv2   # cached-path perplexity
      minillama kv --list                  # cache codecs and presets
    """
    ctx.obj = {"debug": debug}


def model_options(f):
    f = click.option("--device", default="cpu", show_default=True, help="cpu or cuda.")(f)
    f = click.option("--model", "model_name", default=None,
                     help="Model folder or Hugging Face repo id (default: SmolLM2-135M-Instruct, offline).")(f)
    return f


def load(model_name: str | None, dtype: str, device: str):
    from minillama.fetch import resolve_model
    from minillama.loader import load_model

    return load_model(resolve_model(model_name), dtype, device)


@cli.command()
@click.option("--force", is_flag=True, help="Rebuild the folder even if it exists.")
def fetch(force):
    """Install the offline default model (SmolLM2-135M-Instruct) into weights/.

    \b
    Example:
      minillama fetch --force
    """
    from minillama.fetch import fetch_default

    click.echo(str(fetch_default(force=force)))


@cli.command()
@click.argument("prompt")
@model_options
@click.option("--max-tokens", default=128, show_default=True, type=click.IntRange(1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0), help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(0), help="0 = off.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16", "float16"]))
@click.option("--kv", "kv", default="fp32", show_default=True, help="KV cache spec (see `minillama kv --list`).")
@click.option("--ctx", default=None, type=click.IntRange(1), help="Cache capacity in tokens (default: model max).")
@click.option("--raw-special", is_flag=True, help="Parse special-token strings in PROMPT as control tokens.")
def generate(prompt, model_name, device, max_tokens, temperature, top_k, top_p, seed, dtype, kv, ctx, raw_special):
    """Raw completion of PROMPT, streamed to stdout; stats on stderr.

    \b
    Examples:
      minillama generate "The capital of France is" --max-tokens 20
      minillama generate "Once upon a time" --temperature 0.8 --top-p 0.9 --kv hadv2
    """
    from minillama.cache import KVCache
    from minillama.codecs import parse_kv
    from minillama.generate import generate as run
    from minillama.sampling import SamplingParams
    from minillama.tokenizer import StreamDecoder

    spec = parse_kv(kv)
    lm = load(model_name, dtype, device)
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


def main():
    cli(prog_name="minillama")


from minillama import cli_commands  # noqa: E402,F401  (registers kv, ppl, chat, bench)
