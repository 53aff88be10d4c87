"""``minillama ppl``: cached-path perplexity of KV schemes."""

from __future__ import annotations

import click

from minillama.app.options import (
    DTYPES,
    check_transformers_engine,
    engine_option,
    load,
    load_transformers,
    model_options,
    progress_bars,
    read_text,
    text_options,
)
from minillama.errors import UserError


@click.command()
@model_options()
@text_options(default_dataset=None)
@click.option("--tokens", "n", default=896, show_default=True, type=int, help="Tokens per window (N).")
@click.option("--prefill", default=128, show_default=True, type=int, help="Tokens prefilled before scoring (P).")
@click.option("--offset", default=0, show_default=True, type=click.IntRange(0), help="First token of the first window.")
@click.option(
    "--windows", default=1, show_default=True, type=click.IntRange(1), help="Consecutive windows, run as one batch."
)
@click.option("--kv", "kvs", multiple=True, help="KV scheme (repeatable). Default: fp16, kivi4, hadv2.")
@click.option("--dtype", default="float32", show_default=True, type=DTYPES)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of the table.")
@click.option("--no-blind", is_flag=True, help="Skip the blind (no-cache) pass.")
@click.option(
    "--chunk",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="Decode K tokens per step (faster, an approximation).",
)
@click.option(
    "--ctx",
    default=None,
    type=click.IntRange(2),
    help="Cache capacity below the window: the ring evicts (sinks kept), streaming past the model's context.",
)
@click.option(
    "--bucket", default=None, type=click.IntRange(1), help="Also report perplexity per bucket of this many positions."
)
@click.option("--frontier", is_flag=True, help="Evaluate every preset (the bits-vs-quality frontier).")
@engine_option
@click.option(
    "--sensitivity",
    is_flag=True,
    help="Where one --kv scheme loses: each layer's K or V quantized alone, the rest float32 (2L + 3 variants).",
)
@click.option(
    "--plot",
    "plot_path",
    default=None,
    help="Write a PNG: with --frontier ppl (or KLD) vs bits/element; with --bucket ppl per range of positions.",
)
@click.option(
    "--plot-y",
    type=click.Choice(["ppl", "kld"]),
    default="ppl",
    show_default=True,
    help="The plot's y axis: perplexity, or mean KL divergence from the exact model.",
)
@click.option(
    "--peers",
    "peers_file",
    default="bench/results/peers.json",
    show_default=True,
    help="Peer points for the plot (from bench/peers.py).",
)
def ppl(
    model_name,
    weights,
    device,
    backend,
    text_file,
    dataset,
    n,
    prefill,
    offset,
    windows,
    kvs,
    dtype,
    as_json,
    no_blind,
    chunk,
    ctx,
    bucket,
    frontier,
    engine,
    sensitivity,
    plot_path,
    plot_y,
    peers_file,
):
    """Cached-path perplexity of KV schemes, with KL divergence and top-1 agreement against the
    exact model and the blind (no-cache) perplexity beside it.

    \b
    Examples:
      minillama ppl --dataset hamlet --windows 4
      minillama ppl --text book.txt --kv fp16 --kv int8 --kv kivi4 --kv hadv2 --json
      minillama ppl --dataset wikitext2 --windows 4 --frontier --plot frontier.png   # needs the HF hub once
      minillama ppl --dataset hamlet --tokens 8192 --prefill 7168 --kv fp16 --kv hadv2 --no-blind
      minillama ppl --dataset hamlet --tokens 20000 --ctx 1024 --bucket 1024 --kv k=fp16,v=fp16,sinks=4 --plot stream.png
      minillama ppl --dataset hamlet --sensitivity --kv k3v2lm --plot k3v2lm_map.png
      minillama ppl --engine transformers -m Qwen/Qwen2.5-0.5B --device auto --kv fp16 --kv hadv2 --kv hf-quanto4
    """
    import json

    from minillama.eval.perplexity import check_window, evaluate, format_table
    from minillama.kv.spec import PRESETS, maps, parse_kv

    if plot_path and not (frontier or bucket or sensitivity):
        raise UserError(
            "--plot draws the frontier (add --frontier), the streaming curve (add --bucket N) "
            "or the sensitivity map (add --sensitivity)"
        )
    if sensitivity and (len(kvs) != 1 or frontier or ctx or bucket or chunk > 1):
        raise UserError(
            "--sensitivity maps one scheme: give exactly one --kv, without --frontier, --ctx, --bucket or --chunk"
        )
    names = list(PRESETS) if frontier else list(kvs or ("fp16", "kivi4", "hadv2"))
    if frontier and "fp16" in names:
        names.insert(0, names.pop(names.index("fp16")))  # the baseline row first
    specs = [parse_kv(s) for s in names if not (engine == "transformers" and s.startswith("hf-"))]
    if text_file and dataset:
        raise UserError("give either --text or --dataset, not both")
    check_window(n, prefill, chunk, ctx, bucket)  # before the model loads
    if not (text_file or dataset):
        raise UserError("nothing to evaluate: pass --text FILE or --dataset hamlet|wikitext2")
    text = read_text(text_file, dataset)
    if engine == "transformers":  # whole windows, one token a step: no ring, chunks or maps
        check_transformers_engine(
            **{"--ctx": ctx, "--bucket": bucket, "--chunk": chunk > 1, "--frontier": frontier},
            **{"--sensitivity": sensitivity, "--plot": plot_path, "--backend": backend, "--weights": weights},
        )
        transformers_table(model_name, text, names, n, prefill, offset, windows, dtype, device, as_json)
        return
    lm = load(model_name, dtype, device, backend, weights, int8_activations=False)  # the cache's noise alone
    if frontier:  # the per-layer maps made for a model with this many layers
        shipped = (parse_kv(m) for m in maps())
        specs += [m for m in shipped if len(m.layer_codecs) == lm.config.num_hidden_layers]
    ids = lm.tokenizer.encode(text)

    def first_line(label: str, total: int) -> str:  # the text held the windows: the job's size, before it starts
        return (
            f"ppl: {label} x {windows} window(s): {total} decode steps after a prefill of {prefill} "
            "(the schemes decode together as one batch unless --ctx streams)"
        )

    with progress_bars(first_line) as progress:
        if sensitivity:
            from minillama.eval.sensitivity import format_map, plot_map
            from minillama.eval.sensitivity import sensitivity as sensitivity_map

            rows = sensitivity_map(lm, ids, specs[0], n, prefill, offset, windows, dtype, progress)
        else:
            results = evaluate(
                lm,
                ids,
                specs,
                n,
                prefill,
                offset,
                windows,
                chunk,
                not no_blind,
                dtype,
                progress,
                ctx,
                bucket,
            )
    if sensitivity:
        if plot_path:
            plot_map(rows, plot_path)
        click.echo(json.dumps(rows, indent=2) if as_json else format_map(rows))
        return
    if plot_path:
        from pathlib import Path

        from minillama.eval.frontier import load_peers, plot, plot_buckets

        if bucket:  # the streaming curve: perplexity per range of positions
            plot_buckets([r.to_dict() for r in results], plot_path, lm.config.max_position_embeddings)
        else:
            plot(results, plot_path, load_peers(Path(peers_file)) if plot_y == "ppl" else [], plot_y)
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        click.echo(format_table(results, chunk))


def transformers_table(model_name, text, names, n, prefill, offset, windows, dtype, device, as_json) -> None:
    """ppl --engine transformers: the same ruler on a transformers model (minillama/hf/ruler.py)."""
    import json

    from minillama.eval.perplexity import format_table
    from minillama.hf.ruler import HFTokens, evaluate_hf

    model, tokenizer, name = load_transformers(model_name, dtype, device, names)
    tokens = HFTokens(tokenizer)
    ids = tokens.encode(text)
    with progress_bars() as progress:
        results = evaluate_hf(
            model,
            name,
            ids,
            names,
            n,
            prefill,
            offset,
            windows,
            tokens.bos_id if tokens.add_bos else None,
            dtype,
            progress,
        )
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        click.echo(format_table(results))
