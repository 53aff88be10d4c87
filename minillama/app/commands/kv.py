"""``minillama kv``: the cache specs, and the exact byte budget of one."""

from __future__ import annotations

import click


@click.command("kv")
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
    from minillama.kv.budget import byte_budget, describe_codecs

    if list_ or not spec:
        click.echo(describe_codecs())
        return
    from minillama.kv.spec import parse_kv
    from minillama.model.config import LlamaConfig
    from minillama.model.fetch import resolve_model
    from minillama.model.loader import resolve_model_path

    parsed = parse_kv(spec)
    cfg = LlamaConfig.from_file(resolve_model_path(resolve_model(model_name)) / "config.json")
    click.echo(byte_budget(cfg.num_hidden_layers, cfg.n_kv_heads, cfg.head_dim, parsed, tokens))
