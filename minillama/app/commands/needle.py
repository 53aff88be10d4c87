"""``minillama needle``: passkey / multi-key retrieval across lengths and depths, on the cached path."""

from __future__ import annotations

import click

from minillama.app.options import (
    DTYPES,
    SEED,
    check_transformers_engine,
    engine_option,
    load,
    load_transformers,
    model_options,
    read_text_file,
)
from minillama.errors import UsageError, UserError


def numbers(kind):
    """A click type for comma-separated numbers: "1024,2048" -> [1024, 2048]."""

    def parse(text):
        try:
            return [kind(x) for x in str(text).split(",") if x.strip()]
        except ValueError:
            raise click.BadParameter(f"expected comma-separated numbers, got {text!r}") from None

    return parse


@click.command()
@model_options()
@click.option("--kv", "kvs", multiple=True, help="KV scheme (repeatable). Default: fp16, kivi4, hadv2.")
@click.option("--lengths", default="1024,2048,4096,8192", show_default=True, help="Prompt lengths in tokens.")
@click.option("--depths", default="0.1,0.5,0.9", show_default=True, help="Needle depths, 0 (start) to 1 (end).")
@click.option(
    "--trials", default=1, show_default=True, type=click.IntRange(1), help="Random keys per cell (one batch)."
)
@click.option("--task", type=click.Choice(["passkey", "multikey"]), default="passkey", show_default=True)
@click.option("--haystack", "haystack_file", default=None, help="A UTF-8 text whose sentences replace the filler.")
@click.option("--ctx", default=None, type=click.IntRange(2), help="Cache capacity; below a length the ring evicts.")
@click.option("--seed", default=0, show_default=True, type=SEED, help="Keys and positions (the same for every scheme).")
@click.option("--dtype", default="bfloat16", show_default=True, type=DTYPES)
@click.option("--json", "as_json", is_flag=True, help="Print JSON rows instead of the table.")
@click.option("--plot", "plot_path", default=None, help="Write the depth x length heatmap as a PNG.")
@engine_option
def needle(
    model_name,
    weights,
    device,
    backend,
    kvs,
    lengths,
    depths,
    trials,
    task,
    haystack_file,
    ctx,
    seed,
    dtype,
    as_json,
    plot_path,
    engine,
):
    """Needle-in-a-haystack retrieval through each KV cache: accuracy per length and depth.

    \b
    Examples:
      minillama needle                                        # fp16, kivi4, hadv2 at 1k-8k
      minillama needle --kv fp16 --kv k3v2lm --lengths 4096 --depths 0,0.25,0.5,0.75,1 --trials 4
      minillama needle --task multikey --haystack book.txt --json
      minillama needle --kv fp16 --lengths 2048 --ctx 1024    # the ring evicts: early needles are lost
      minillama needle --engine transformers -m Qwen/Qwen2.5-7B --device cuda --kv fp16 --kv hadv2 --kv hf-quanto4
    """
    import json
    import sys

    from minillama.eval import needle as nh
    from minillama.kv.spec import parse_kv

    names = list(kvs or ("fp16", "kivi4", "hadv2"))
    specs = [parse_kv(s) for s in names if not (engine == "transformers" and s.startswith("hf-"))]
    lengths_, depths_ = numbers(int)(lengths), numbers(float)(depths)
    if not lengths_ or min(lengths_) < 64:
        raise UsageError("--lengths must be token counts of at least 64, e.g. 1024,2048")
    if not depths_ or not all(0 <= d <= 1 for d in depths_):
        raise UsageError("--depths must be fractions from 0 to 1, e.g. 0.1,0.5,0.9")
    if engine == "transformers":  # the whole prompt is held: transformers' masks assume it
        check_transformers_engine(**{"--ctx": ctx, "--backend": backend, "--weights": weights})
    haystack = nh.split_sentences(read_text_file(haystack_file)) if haystack_file else None
    if haystack_file and not haystack:
        raise UserError(f"{haystack_file} has no sentences to use as a haystack")
    if ctx and max(lengths_) > ctx:
        click.echo(
            f"note: prompts of {', '.join(str(n) for n in lengths_ if n > ctx)} tokens do not fit --ctx {ctx}: "
            "the ring evicts their start, and a needle it dropped cannot be retrieved",
            err=True,
        )
    if engine == "transformers":
        model, tokenizer, _ = load_transformers(model_name, dtype, device, names)
        limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    else:
        lm = load(model_name, dtype, device, backend, weights, int8_activations=False)
        limit = lm.config.max_position_embeddings
    if limit and max(lengths_) > limit:
        click.echo(f"note: {max(lengths_)} tokens is beyond the model's trained context ({limit})", err=True)
    total = nh.prompt_tokens(names, lengths_, depths_, trials)
    prompts = len(names) * len(lengths_) * len(depths_) * trials
    click.echo(
        f"needle: {prompts} prompts, about {total:,} tokens to prefill (the bar counts tokens, "
        "its estimate firms up after the first chunks)",
        err=True,
    )
    with click.progressbar(length=total, label="needle", file=sys.stderr, show_pos=True, show_eta=True) as bar:
        if engine == "transformers":
            from minillama.hf.ruler import needle_hf

            rows = needle_hf(model, tokenizer, names, lengths_, depths_, trials, task, haystack, seed, bar.update)
        else:
            rows = nh.run(lm, specs, lengths_, depths_, trials, task, haystack, ctx, seed, bar.update)
    if any(r.evicted for r in rows):
        click.echo(
            f"note: the cache evicted tokens (--ctx {ctx} is below a length); "
            "a needle the ring dropped cannot be retrieved",
            err=True,
        )
    if plot_path:
        nh.plot(rows, plot_path)
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in rows], indent=2))
    else:
        click.echo(nh.format_table(rows))
