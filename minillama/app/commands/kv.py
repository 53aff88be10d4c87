"""``minillama kv``: the cache specs, and the exact byte budget of one."""

from __future__ import annotations

import click

from minillama.app.options import Finite, model_options


def describe_codecs() -> str:
    """Every preset, map and codec family with its bits/element formula, as ``minillama kv --list``
    prints them."""
    from minillama.kv.codecs import CODECS, FloatCodec
    from minillama.kv.spec import GRAMMAR, PRESET_NOTES, PRESETS, maps, read_map

    lines = ["Presets (--kv NAME; fp32, bf16 and fp16 store keys and values unquantized):"]
    for name, text in PRESETS.items():
        if name in PRESET_NOTES:
            lines.append(f"  {name:<9} {PRESET_NOTES[name]}")
            lines.append(f"  {'':<9}   {text}")
    lines += ["", "Maps of the default model's 30 layers (--kv NAME; kv/maps/NAME.kv, or --kv FILE.kv of your own):"]
    for name, path in maps().items():
        lines.append(f"  {name:<9} {read_map(path)[1]}")
    families: dict[str, list[str]] = {}  # codecs of one formula, b standing for the bits
    for c in CODECS.values():
        formula = (
            "32, 16, 16 (unquantized)"
            if isinstance(c, FloatCodec)
            else c.bits_formula().replace(f"{c.bits} +", "b +", 1)
        )
        families.setdefault(formula + (", Hadamard-rotated" if c.rotate else ""), []).append(c.name)
    lines += ["", "Codecs: bits an element (b the codec's bits, G the group, D the head size):"]
    for formula, names in families.items():
        lines.append(f"  {' '.join(names):<20} {formula}")
    lines += [
        f"  {'lm{b}f{nb}:{widths}':<20} b + 8 nb/D  (keys in nb RoPE frequency blocks, each KV head's widths in digits)",
        "",
        f"Spec: --kv {GRAMMAR}",
        "Defaults: group 32; residual 32 when anything is quantized, else 0; sinks 0; center 0; rope post;",
        "positions absolute; start 0. Residual and sink tokens are kept in fp16 (unquantized codecs: their dtype).",
        "center=1: keys minus a per-sequence channel mean. rope=pre: keys stored before RoPE; positions=cache",
        "numbers held tokens by slot. start=N: exact until N tokens are held. tier=N:CODEC: the N tokens before",
        "the residual in a finer codec. bits=auto:B: each layer's K and V among lm2hb/lm3hb/lm4hb from the prompt.",
        "docs/cache.md explains each one.",
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
    "--out", type=click.Path(dir_okay=False), help="With allocate: write the spec as a map FILE.kv (--kv FILE.kv)."
)
@click.option(
    "--byte-scales",
    is_flag=True,
    help="With allocate: Lloyd-Max codecs with one-byte log scales (lm3h -> lm3hb), priced by their fp16 maps.",
)
def kv(spec, path, list_, model_name, tokens, as_json, maps, bits, out, byte_scales):
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
      minillama kv allocate --map k3v2lm.json --map k4v3lmc.json --bits 3.0 --byte-scales --out mix.kv
      minillama generate "Hello" --kv mix.kv
    """
    from minillama.errors import UsageError, UserError

    if (maps or bits is not None or byte_scales or out) and spec != "allocate":
        raise UserError(
            "--map, --bits, --byte-scales and --out go with allocate: minillama kv allocate --map MAP.json ... --bits B"
        )
    if spec == "allocate":
        if path:
            raise UserError(f"unexpected argument {path!r}: give the maps with --map FILE")
        if not maps or bits is None:
            raise UserError("kv allocate needs at least one --map FILE (ppl --sensitivity --json) and --bits B")
        allocate_command(maps, bits, model_name, tokens, as_json, byte_scales, out)
        return
    if spec == "inspect":
        import json

        from minillama.eval.budget import format_inspect, inspect_file

        if not path:
            raise UsageError("kv inspect needs a cache file: minillama kv inspect FILE")
        info = inspect_file(path)
        click.echo(json.dumps(info, indent=2) if as_json else format_inspect(info))
        return
    if path:
        raise UsageError(f"unexpected argument {path!r}: give one SPEC (or inspect FILE)")
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


def allocate_command(maps, bits, model_name, tokens, as_json, byte_scales=False, out=None) -> None:
    """``kv allocate``: read the maps, choose, print the summary and the spec (last line); with
    `out`, also write the spec as a map file that ``--kv FILE.kv`` reads."""
    import json
    from pathlib import Path

    from minillama.errors import UserError, shown
    from minillama.kv.spec import read_map

    if out is not None:  # checked before any work: a map file, new or replaced, never anything else
        if not out.endswith(".kv"):
            raise UserError(f"--out {shown(out)}: a map file's name ends in .kv (--kv reads it by that)")
        if Path(out).exists():
            read_map(Path(out))  # refuses a file that is not a map, which is left as it was

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
    if out is not None:
        about = f"# {bits:g} bits from {', '.join(Path(m).name for m in maps)}: {a.spec.layer_mix()}\n"
        temp = Path(out).with_name(f".{Path(out).name}.tmp")
        temp.write_text(about + a.spec.canonical() + "\n", encoding="utf-8")
        temp.replace(out)
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
