"""``minillama chat``: the chat REPL over a cache kept across turns."""

from __future__ import annotations

import click

from minillama.app.options import DEFAULT_DTYPE, DTYPES, load, model_options, sampling_options, seed_or_random


@click.command()
@model_options()
@click.option("--kv", default="fp16", show_default=True, help="KV cache scheme (see `minillama kv --list`).")
@click.option(
    "-c", "--ctx", default=None, type=click.IntRange(1), help="Cache capacity in tokens (default: model max)."
)
@click.option(
    "--on-full",
    type=click.Choice(["evict", "stop"]),
    default="evict",
    show_default=True,
    help="When the cache is full: evict the oldest tokens, or stop with a clear message.",
)
@click.option("--system", default=None, help="System prompt.")
@sampling_options(
    {
        "temperature": "generation_config, else 0.7",
        "top-k": "generation_config, else 0",
        "top-p": "generation_config, else 0.9",
        "min-p": "0.05",
        "repeat-penalty": "generation_config, else 1.1",
        "seed": "random",
    }
)
@click.option("-n", "--max-tokens", default=512, show_default=True, type=click.IntRange(1), help="Longest reply.")
@click.option("--dtype", default=DEFAULT_DTYPE, show_default=True, type=DTYPES)
@click.option(
    "--prompt-cache",
    default=None,
    help="Resume the session saved in this file (conversation and cache, no prefill when model and --kv "
    "match) and save it there after every reply.",
)
def chat(
    model_name,
    weights,
    device,
    backend,
    kv,
    ctx,
    on_full,
    system,
    temperature,
    top_k,
    top_p,
    min_p,
    repeat_penalty,
    seed,
    max_tokens,
    dtype,
    prompt_cache,
):
    """Chat with a model; the KV cache is kept across turns and shown by /stats.

    \b
    Examples:
      minillama chat                         # default model, fp16 cache
      minillama chat --kv hadv2 --ctx 4096   # 4-bit keys, Hadamard 2-bit values
      echo "What is the capital of France?" | minillama chat --temperature 0
      minillama chat --kv hadv2 --prompt-cache session.kv   # resumes session.kv, saves it after each reply
    Type /help inside for commands. End a line with \\ to continue on the next line.
    """
    import sys

    from minillama.app.chat import ChatSession, check_save_target, repl, sampling_from_generation_config
    from minillama.kv.spec import parse_kv

    spec = parse_kv(kv)
    if prompt_cache:
        check_save_target(prompt_cache)  # before the model loads: a file that is not ours is never touched
    from minillama.native.backend import adapt_threads

    adapt_threads()  # decode on one core fewer while another process holds one (unless --threads)
    click.get_current_context().call_on_close(lambda: adapt_threads(False))  # for this command only
    lm = load(model_name, dtype, device, backend, weights)
    overrides = {
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "min_p": min_p,
        "repeat_penalty": repeat_penalty,
    }
    params = sampling_from_generation_config(
        lm.generation_config, overrides, where=str(lm.path / "generation_config.json")
    )
    seed = seed_or_random(seed)
    session = ChatSession(lm, spec, ctx, system, params, seed, max_tokens, on_full)
    if params.temperature > 0:  # sampled: the seed repeats the session's replies
        click.echo(f"seed {seed} (--seed {seed} repeats these replies)", err=True)
    if prompt_cache:
        from pathlib import Path

        from minillama.errors import UserError

        if Path(prompt_cache).exists():
            try:
                click.echo(f"{session.load(prompt_cache)}; saved there again after every reply", err=True)
            except UserError as e:
                click.echo(f"note: {e}; starting a new session, saved over it after the first reply", err=True)
        session.autosave = prompt_cache
    repl(session, sys.stdin.isatty(), click.echo, lambda m: click.echo(m, err=True))
