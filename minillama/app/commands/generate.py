"""``minillama generate``: one reply to a prompt (through the model's chat template, or raw
completion with --raw), streamed; optionally through a prompt cache file."""

from __future__ import annotations

import click
import torch

from minillama.app.options import (
    CHARS_PER_TOKEN_BOUND,
    DEFAULT_DTYPE,
    DTYPES,
    load,
    model_options,
    read_text_file,
    sampling_options,
    seed_or_random,
)
from minillama.errors import UserError

LONGEST_CONTEXT = 1 << 20  # tokens: the bound on a prompt read before the model says its own


def read_prompt(prompt: str | None, prompt_file: str | None, ctx: int | None = None) -> str:
    """The PROMPT argument (or -p), or the text of --prompt-file (``-`` reads standard input),
    read no further than a prompt that can fit a cache of `ctx` tokens could reach."""
    if (prompt is None) == (prompt_file is None):
        raise UserError("give a PROMPT (or -p PROMPT) or -f/--prompt-file FILE (- for standard input), one of them")
    if prompt_file is None:
        return prompt
    tokens = ctx or LONGEST_CONTEXT
    why = f"more than {tokens:,} tokens" + (" (--ctx)" if ctx else "") + ": shorten the prompt"
    return read_text_file(prompt_file, tokens * CHARS_PER_TOKEN_BOUND, why)


@click.command()
@click.argument("prompt", required=False)
@click.option("-p", "--prompt", "prompt_option", default=None, help="The prompt, instead of the PROMPT argument.")
@click.option("-f", "--prompt-file", default=None, help="Read the prompt from a UTF-8 file (- for standard input).")
@click.option("--raw", is_flag=True, help="Complete the prompt as plain text, without the model's chat template.")
@click.option("--system", default=None, help="A system message before the prompt (chat template only).")
@model_options()
@click.option("-n", "--max-tokens", default=128, show_default=True, type=click.IntRange(1))
@sampling_options(
    {"temperature": "0", "top-k": "0", "top-p": "1", "min-p": "0", "repeat-penalty": "1", "seed": "random"}
)
@click.option("--dtype", default=DEFAULT_DTYPE, show_default=True, type=DTYPES)
@click.option("--kv", "kv", default="fp16", show_default=True, help="KV cache spec (see `minillama kv --list`).")
@click.option(
    "-c", "--ctx", default=None, type=click.IntRange(1), help="Cache capacity in tokens (default: model max)."
)
@click.option(
    "--on-full",
    type=click.Choice(["stop", "evict"]),
    default="stop",
    show_default=True,
    help="A prompt or reply longer than --ctx: stop (a prompt that does not fit is refused), or evict "
    "the oldest tokens and go on.",
)
@click.option("--ignore-eos", is_flag=True, help="Go on past the model's end-of-sequence tokens (as llama.cpp's).")
@click.option(
    "--prompt-cache",
    default=None,
    help="A cache file: reuse its longest common prefix with the prompt when it matches the model and "
    "--kv, and write the prompt's cache to it when the run completes. Only a missing file or a "
    "minillama cache file is ever replaced.",
)
@click.option("--prompt-cache-ro", is_flag=True, help="Use the --prompt-cache file but never write it.")
@click.option(
    "--raw-special", is_flag=True, help="Complete PROMPT raw, its special-token strings parsed as control tokens."
)
def generate(
    prompt,
    prompt_option,
    prompt_file,
    raw,
    system,
    model_name,
    weights,
    device,
    backend,
    max_tokens,
    temperature,
    top_k,
    top_p,
    min_p,
    repeat_penalty,
    seed,
    dtype,
    kv,
    ctx,
    on_full,
    ignore_eos,
    prompt_cache,
    prompt_cache_ro,
    raw_special,
):
    """The model's reply to PROMPT, streamed to stdout; stats on stderr. A model with a chat
    template gets PROMPT as a user message (after --system), as mlx_lm.generate does; --raw
    completes it as plain text. Stops at the model's end-of-sequence token (--ignore-eos goes
    on) or after --max-tokens.

    \b
    Examples:
      minillama generate "What is the capital of France?" -n 20
      minillama generate "The capital of France is" --raw -n 20     # plain completion
      minillama generate "Write a haiku" --temperature 0.8 --top-p 0.9 --kv hadv2
      minillama generate -f doc.txt --kv hadv2 --prompt-cache doc.kv   # the second run reuses doc.kv
    """
    from minillama.kv.cache import ContextFullError
    from minillama.kv.file import check_replaceable
    from minillama.kv.spec import parse_kv
    from minillama.model.generate import GenerateOptions
    from minillama.model.prompt_cache import Completion
    from minillama.model.sampling import SamplingParams
    from minillama.model.tokenizer import StreamDecoder

    if prompt_cache_ro and not prompt_cache:
        raise UserError("--prompt-cache-ro reads the --prompt-cache FILE: give that too")
    if prompt is not None and prompt_option is not None:
        raise UserError("give the prompt once: as the PROMPT argument or as -p PROMPT")
    prompt = prompt if prompt is not None else prompt_option
    raw = raw or raw_special
    if system is not None and raw:
        raise UserError("--system goes into the chat template: drop --raw/--raw-special, or put it in the prompt")
    if prompt_cache and not prompt_cache_ro:
        check_replaceable(prompt_cache)  # before the model loads: a file that is not a cache is never touched
    text = read_prompt(prompt, prompt_file, ctx)
    spec = parse_kv(kv)
    from minillama.native.backend import adapt_threads

    adapt_threads()  # decode on one core fewer while another process holds one (unless --threads)
    click.get_current_context().call_on_close(lambda: adapt_threads(False))  # for this command only
    lm = load(model_name, dtype, device, backend, weights)
    tok = lm.tokenizer
    templated = not raw and tok.chat_template is not None
    if system is not None and not templated:
        raise UserError("--system goes into the chat template, and this model has none: put it in the prompt")
    if not text:
        raise UserError("the prompt is empty: give some text")
    if templated:
        from minillama.app.chat_template import encode_chat

        messages = [{"role": "system", "content": system}] * (system is not None) + [{"role": "user", "content": text}]
        ids = encode_chat(tok, messages, add_generation_prompt=True)
    else:
        ids = tok.encode_with_specials(text) if raw_special else tok.encode(text)
        if tok.add_bos and tok.bos_id is not None:
            ids = [tok.bos_id] + ids
    capacity = ctx or lm.config.max_position_embeddings
    if len(ids) > capacity:
        if on_full == "stop":
            raise UserError(
                f"the prompt is {len(ids):,} tokens, more than the cache holds (--ctx {capacity:,}): "
                "raise --ctx, shorten the prompt, or pass --on-full evict to drop its start"
            )
        click.echo(
            f"warning: the prompt is {len(ids):,} tokens and the cache holds {capacity:,}: its first "
            f"{len(ids) - capacity:,} or more are evicted (--on-full evict)",
            err=True,
        )
    stops = frozenset() if ignore_eos else frozenset(lm.stop_ids())
    given = {"top_k": top_k, "top_p": top_p, "min_p": min_p, "repeat_penalty": repeat_penalty}
    params = SamplingParams(  # greedy unless --temperature; SamplingParams' defaults turn the rest off
        temperature=temperature or 0.0, **{name: value for name, value in given.items() if value is not None}
    )
    seed = seed_or_random(seed)
    options = GenerateOptions(max_tokens, params, stops, torch.Generator(device).manual_seed(seed))
    run = Completion(
        lm, ids, spec, options, capacity=capacity, on_full=on_full, prompt_cache=prompt_cache, read_only=prompt_cache_ro
    )
    if run.note and not run.reused:  # why the file was not used, before the long prefill
        then = "" if prompt_cache_ro else "; this run's cache replaces it when the run completes"
        click.echo(f"{run.note}; prefilling the whole prompt{then}", err=True)
    stream = StreamDecoder(tok)
    stats, ended = None, ""
    try:
        for token, stats in run:  # noqa: B007 (the last stats are reported after the loop)
            if token in stops:  # the last token: generation ends after it (not printed)
                ended = " (end of sequence)"
                continue
            click.echo(stream.push(token), nl=False)
    except ContextFullError:
        ended = f" (the cache is full at --ctx {capacity:,}; --on-full evict goes on)"
    click.echo(stream.flush())
    reused, prefill_s = run.reused, run.prefill_s
    new = len(ids) - reused
    speed = (
        f"prefilled {new} at {new / prefill_s:.1f} tok/s"
        if new and prefill_s
        else "nothing to prefill (all from the cache)"
    )
    generated = stats.generated_tokens if stats else 0
    click.echo(
        (run.note + " | " if run.note and reused else "")
        + f"prompt {len(ids)} tokens{' (chat template)' if templated else ''}, {speed} | generated "
        f"{generated} tokens{ended}, {stats.decode_tokens_per_s if stats else float('nan'):.1f} tok/s decode"
        + (f" | seed {seed}" if params.temperature > 0 else ""),
        err=True,
    )
