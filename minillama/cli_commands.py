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
