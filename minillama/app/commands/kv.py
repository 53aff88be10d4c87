"""``minillama kv``: the cache specs, and the exact byte budget of one."""

from __future__ import annotations

import click

from minillama.app.options import model_options


def describe_codecs() -> str:
    """Every preset and codec with its bits/element formula, as ``minillama kv --list`` prints them."""
    from minillama.kv.codecs import CODECS
    from minillama.kv.spec import GRAMMAR, PRESET_NOTES, PRESETS

    lines = ["Presets (--kv NAME):"]
    for name, text in PRESETS.items():
        lines.append(f"  {name:<9} {text:<56} {PRESET_NOTES.get(name, '')}")
    lines += ["", f"Codecs (--kv {GRAMMAR}); bits/element (G = group, T = tokens held):"]
    for c in CODECS.values():
        lines.append(f"  {c.name:<7} {c.bits_formula():<58} {c.about}")
    lines += [
        "",
        "Defaults: group 32; residual 32 when anything is quantized, else 0; sinks 0; center 0; rope post;",
        "positions absolute; start 0.",
        "center=1 stores keys minus a per-sequence channel mean (softmax ignores the shift; codes get finer).",
        "rope=pre stores keys before RoPE and rotates them when read; positions=cache numbers held tokens by slot.",
        "start=N keeps every token exact until N are held.",
        "Residual and sink tokens are stored in fp16 (unquantized codecs: in their own dtype).",
    ]
    return "\n".join(lines)


@click.command("kv")
@click.argument("spec", required=False)
@click.argument("path", required=False)
@click.option("--list", "list_", is_flag=True, help="Print presets and codecs with their bits/element formula.")
@model_options(device=False)
@click.option("--tokens", default=2048, show_default=True, type=click.IntRange(1), help="Tokens held.")
@click.option("--json", "as_json", is_flag=True, help="With inspect: print JSON.")
def kv(spec, path, list_, model_name, tokens, as_json):
    """Explain KV cache specs: `--list`, the exact byte budget of SPEC, or `inspect FILE`: what a
    saved cache file (generate/chat --prompt-cache, chat /save) holds.

    \b
    Examples:
      minillama kv --list
      minillama kv hadv2 --tokens 8192
      minillama kv k=int4h,v=int2h,group=64,sinks=4 --tokens 896
      minillama kv inspect doc.kv --json
    """
    if spec == "inspect":
        import json

        from minillama.errors import UserError
        from minillama.eval.budget import format_inspect, inspect_file

        if not path:
            raise UserError("kv inspect needs a cache file: minillama kv inspect FILE")
        info = inspect_file(path)
        click.echo(json.dumps(info, indent=2) if as_json else format_inspect(info))
        return
    if path:
        from minillama.errors import UserError

        raise UserError(f"unexpected argument {path!r}: give one SPEC (or inspect FILE)")
    if list_ or not spec:
        click.echo(describe_codecs())
        return
    from minillama.app.default_model import resolve_model
    from minillama.eval.budget import byte_budget
    from minillama.kv.spec import parse_kv
    from minillama.model.config import LlamaConfig
    from minillama.model.loader import resolve_model_path

    parsed = parse_kv(spec)
    cfg = LlamaConfig.from_file(resolve_model_path(resolve_model(model_name)) / "config.json")
    click.echo(byte_budget(cfg.num_hidden_layers, cfg.n_kv_heads, cfg.head_dim, parsed, tokens))
