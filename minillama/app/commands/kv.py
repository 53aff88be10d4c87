"""``minillama kv``: the cache specs, and the exact byte budget of one."""

from __future__ import annotations

import click

from minillama.app.options import Finite, model_options


def describe_codecs() -> str:
    """Every preset and codec with its bits/element formula, as ``minillama kv --list`` prints them."""
    from minillama.kv.codecs import CODECS
    from minillama.kv.spec import GRAMMAR, MIXES, PRESET_NOTES, PRESETS, parse_kv

    lines = ["Presets (--kv NAME):"]
    for name, text in PRESETS.items():
        lines.append(f"  {name:<9} {text:<56} {PRESET_NOTES.get(name, '')}")
    lines += ["", "Per-layer mixes for the default model's 30 layers (kv allocate; layers= lists each layer's K/V):"]
    for name, text in MIXES.items():
        lines.append(f"  {name:<9} {parse_kv(text).layer_mix():<56} {PRESET_NOTES.get(name, '')}")
    lines += ["", f"Codecs (--kv {GRAMMAR}); bits/element (G = group, T = tokens held):"]
    for c in CODECS.values():
        lines.append(f"  {c.name:<7} {c.bits_formula():<58} {c.about}")
    lines += [
        f"  {'lm{b}f{nb}:{widths}':<7} b + 8 nb/D  (per KV head and RoPE frequency block: Lloyd-Max bits, a byte scale)",
        "    keys in nb frequency blocks, per KV head one digit a block (its bits, highest frequencies first;",
        "    each head's digits add up to nb x b): lm3f2:24.33.15 for 3 KV heads (rows kernel; no SIMD kernel yet)",
        f"  {'{codec}o{N}':<7} + 24 N/D  (dense-and-sparse: a per-token codec plus each row's N largest entries exact)",
        "    fp16 value and byte index, taken in the model's channels before the rotation: lm3hbo1; outliers=N",
        "    (koutliers=N, voutliers=N) gives every quantized codec of both tensors (or one) N a row",
    ]
    lines += [
        "",
        "Defaults: group 32; residual 32 when anything is quantized, else 0; sinks 0; center 0; rope post;",
        "positions absolute; start 0.",
        "center=1 stores keys minus a per-sequence channel mean (softmax ignores the shift; codes get finer).",
        "rope=pre stores keys before RoPE and rotates them when read; positions=cache numbers held tokens by slot.",
        "start=N keeps every token exact until N are held.",
        "bits=auto:B chooses each layer's K and V among lm2hb, lm3hb, lm4hb from every sequence's prefill (the",
        "    newest queries' attention error, kv/auto.py), at most B body bits an element on average.",
        "Residual and sink tokens are stored in fp16 (unquantized codecs: in their own dtype).",
    ]
    return "\n".join(lines)


@click.command("kv")
@click.argument("spec", required=False)
@click.argument("path", required=False)
@click.option("--list", "list_", is_flag=True, help="Print presets and codecs with their bits/element formula.")
@model_options(device=False)
@click.option("--tokens", default=2048, show_default=True, type=click.IntRange(1), help="Tokens held.")
@click.option("--json", "as_json", is_flag=True, help="With inspect or allocate: print JSON.")
@click.option(
    "--map", "maps", multiple=True, metavar="FILE", help="With allocate: a sensitivity map (ppl --sensitivity --json)."
)
@click.option("--bits", type=Finite(min=0, min_open=True), help="With allocate: average bits per element.")
@click.option(
    "--byte-scales",
    is_flag=True,
    help="With allocate: Lloyd-Max codecs with one-byte log scales (lm3h -> lm3hb), priced by their fp16 maps.",
)
def kv(spec, path, list_, model_name, tokens, as_json, maps, bits, byte_scales):
    """Explain KV cache specs: `--list`, the exact byte budget of SPEC, `inspect FILE`: what a
    saved cache file (generate/chat --prompt-cache, chat /save) holds, or `allocate`: a spec
    with each layer's codecs chosen from sensitivity maps under a budget of bits.

    \b
    Examples:
      minillama kv --list
      minillama kv hadv2 --tokens 8192
      minillama kv k=int4h,v=int2h,group=64,sinks=4 --tokens 896
      minillama kv inspect doc.kv --json
      minillama kv allocate --map k3v2lm.json --map k4v3lmc.json --bits 3.0
      minillama kv allocate --map k3v2lm.json --map k4v3lmc.json --bits 3.0 --byte-scales
    """
    from minillama.errors import UserError

    if (maps or bits is not None or byte_scales) and spec != "allocate":
        raise UserError(
            "--map, --bits and --byte-scales go with allocate: minillama kv allocate --map MAP.json ... --bits B"
        )
    if spec == "allocate":
        if path:
            raise UserError(f"unexpected argument {path!r}: give the maps with --map FILE")
        if not maps or bits is None:
            raise UserError("kv allocate needs at least one --map FILE (ppl --sensitivity --json) and --bits B")
        allocate_command(maps, bits, model_name, tokens, as_json, byte_scales)
        return
    if spec == "inspect":
        import json

        from minillama.eval.budget import format_inspect, inspect_file

        if not path:
            raise UserError("kv inspect needs a cache file: minillama kv inspect FILE")
        info = inspect_file(path)
        click.echo(json.dumps(info, indent=2) if as_json else format_inspect(info))
        return
    if path:
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


def allocate_command(maps, bits, model_name, tokens, as_json, byte_scales=False) -> None:
    """``kv allocate``: read the maps, choose, print the summary and the spec (last line)."""
    import json

    from minillama.app.default_model import resolve_model
    from minillama.app.options import read_json
    from minillama.eval.allocation import allocate_from_maps
    from minillama.kv.budget import formula_live_bytes
    from minillama.model.config import LlamaConfig
    from minillama.model.loader import resolve_model_path

    cfg = LlamaConfig.from_file(resolve_model_path(resolve_model(model_name)) / "config.json")
    loaded = [(path, read_json(path)) for path in maps]
    a = allocate_from_maps(loaded, bits, cfg.num_hidden_layers, cfg.head_dim, byte_scales)
    live = formula_live_bytes(cfg.num_hidden_layers, cfg.n_kv_heads, cfg.head_dim, a.spec, tokens)
    effective = 8 * sum(live.values()) / (cfg.num_hidden_layers * 2 * cfg.n_kv_heads * cfg.head_dim * tokens)
    if as_json:
        info = {
            "kv": a.spec.canonical(),
            "budget": bits,
            "body_bits": a.bits,
            "bits_per_element": effective,
            "tokens": tokens,
            "kld_sum": a.cost,
            "counts": a.spec.codec_counts(),
            "notes": a.notes,
        }
        click.echo(json.dumps(info, indent=2))
        return
    for note in a.notes:
        click.echo(f"note: {note}")
    click.echo(f"layers: {a.spec.layer_mix()}")
    click.echo(
        f"body {a.bits:.3f} bits/element (budget {bits:g}); {effective:.3f} with sinks and residual at {tokens} tokens; "
        f"sum of the maps' KLDs {a.cost:.5f}"
    )
    click.echo(a.spec.canonical())
