"""The ``--kv`` spec: which codec each tensor uses, and the cache's windows and options.

    --kv PRESET[,key=value...]      a preset, or a map file (kv/maps/*.kv, or a path to one)
    --kv k=CODEC,v=CODEC[,group=G][,kgroup=G][,vgroup=G][,residual=R][,sinks=S][,center=0|1]
                        [,rope=post|pre][,positions=absolute|cache][,start=N]
                        [,layers=K/V;K/V;...][,tier=N:CODEC]
    --kv bits=auto:B[,group=G][,residual=R][,sinks=S][,center=0|1][,tier=N:CODEC]

A spec is plain data; the cache (``cache.py``) and its stores (``store.py``) act on it.

* ``group`` sets both tensors' group size; ``kgroup``/``vgroup`` set one.
* ``rope=pre`` stores keys *before* the rotary embedding (KVQuant): RoPE turns each pair
  of channels by a position-dependent angle, which smears the per-channel structure that
  per-channel quantization relies on; the keys are rotated when they are read instead.
* ``positions=cache`` (needs ``rope=pre``) gives each held token the position of its slot
  in the cache, sinks first (StreamingLLM), so positions never grow past the capacity and
  a ring can stream forever; ``absolute`` keeps every token's original position.
* ``start=N`` keeps every token exact until N tokens are held (mlx-lm's
  ``quantized_kv_start``): short contexts pay no quantization error.
* ``layers=K/V;K/V;...``: every layer's (K, V) codecs, overriding ``k=`` and ``v=`` (mixed
  precision by layer; ``minillama kv allocate`` writes one from sensitivity maps, kv/allocate.py).
* ``tier=N:CODEC``: the N tokens just older than the exact residual are kept in a finer codec
  than the body (an age tier, kv/store.py): ``residual=8,tier=56:lm4hb`` keeps the newest 8
  exact and the 56 before them at 4 bits, the rest in each layer's body codec. The recent
  tokens are where attention looks most.
* ``bits=auto:B``: every layer's K and V codec chosen per sequence from its prompt (kv/auto.py),
  at most B body bits an element on average.

A *map* is a spec with ``layers=`` kept in a text file, as ``minillama kv allocate`` writes it:
the per-layer choices fit one model (its layer count), so they are data, not code. The package
ships the default model's best maps (``kv/maps/``), reachable by name like a preset.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from minillama.errors import UserError, shown
from minillama.kv.auto import CANDIDATES as AUTO_CANDIDATES
from minillama.kv.codecs import CODECS, Codec
from minillama.kv.freq_blocks import frequency_blocks


@dataclass(frozen=True)
class KVSpec:
    """What the cache stores: a codec for K, one for V, their group sizes, windows and options."""

    k: Codec
    v: Codec
    kgroup: int = 32
    vgroup: int = 32
    residual: int = 0
    sinks: int = 0
    name: str = ""
    center: bool = False  # subtract each sequence's per-channel key mean (see store.py)
    rope: str = "post"  # "post": keys stored after RoPE; "pre": before, rotated at read
    positions: str = "absolute"  # "absolute" or "cache" (slot positions; needs rope="pre")
    start: int = 0  # every token stays exact until this many are held
    # Every layer's (K, V) codecs, overriding k and v: mixed precision by layer (layers=; the
    # sensitivity map quantizes one tensor of one layer, eval/sensitivity.py).
    layer_codecs: tuple[tuple[Codec, Codec], ...] = ()
    tier: int = 0  # tokens kept in tier_codec between the body and the exact residual
    tier_codec: Codec | None = None
    # bits=auto:B: every layer's codecs chosen by the cache from each sequence's prefill, at most B
    # body bits on average (kv/auto.py); 0 = off. Until a cache chooses, layer_codecs is empty and
    # k, v are the costliest candidate (what the cache reserves memory for).
    auto: float = 0.0

    @property
    def quantized(self) -> bool:
        return self.k.quantized or self.v.quantized

    @property
    def unit(self) -> int:
        """Eviction unit: whole groups whenever a tensor of any layer is per-channel."""
        keys = [self.k] + [k for k, _ in self.layer_codecs]
        values = [self.v] + [v for _, v in self.layer_codecs]
        return max(*(v.unit(self.vgroup) for v in values), *(k.unit(self.kgroup) for k in keys))

    def asked(self) -> KVSpec:
        """The spec as written: an auto spec without the layers a cache chose for it."""
        return replace(self, layer_codecs=()) if self.auto else self

    @property
    def min_capacity(self) -> int:
        """The fewest tokens a cache of this spec holds: its sinks, residual and tier, and one unit."""
        return self.sinks + self.residual + self.tier + self.unit

    def tier_of(self, codec: Codec) -> tuple[int, Codec | None]:
        """(tokens, codec) of the age tier of a tensor stored with `codec`: none for exact tensors."""
        return (self.tier, self.tier_codec) if self.tier and codec.quantized else (0, None)

    def tensors(self, layer: int = -1) -> list[tuple[Codec, int, bool]]:
        """(codec, group, centered) for K, then V, of this layer (-1 or no layers=: k and v)."""
        k, v = (
            self.layer_codecs[layer] if self.layer_codecs and 0 <= layer < len(self.layer_codecs) else (self.k, self.v)
        )
        return [(k, self.kgroup, self.center), (v, self.vgroup, False)]

    def codec_counts(self) -> dict[str, dict[str, int]]:
        """With layers=: how many layers store K ("k") and V ("v") with each codec, by name."""
        counts: dict[str, dict[str, int]] = {"k": {}, "v": {}}
        for pair in self.layer_codecs:
            for side, codec in zip("kv", pair):
                counts[side][codec.name] = counts[side].get(codec.name, 0) + 1
        return counts

    def body_bits(self, head_dim: int, n_layers: int) -> float:
        """Bits an element of the quantized body, codes and scales, averaged over every layer's K and V:
        what ``kv allocate --bits`` and ``bits=auto:B`` bound (sinks, residual and tier not counted)."""
        bits = [c.body_bits(head_dim, g) for i in range(n_layers) for c, g, _ in self.tensors(i)]
        return sum(bits) / len(bits)

    def auto_state(self, head_dim: int, n_layers: int) -> str:
        """For a bits=auto spec, what its cache chose (or that it has not yet): a line for /stats and kv."""
        if not self.layer_codecs:
            return f"bits=auto:{self.auto:g}: each layer's K and V not chosen yet (at the first prompt's prefill)"
        return (
            f"bits=auto:{self.auto:g} chose {self.layer_mix()} "
            f"({self.body_bits(head_dim, n_layers):.3f} body bits an element)"
        )

    def layer_mix(self) -> str:
        """``codec_counts`` as text ("" without layers=): "K lm3h x28, lm4h x2; V lm2h x30"."""
        if not self.layer_codecs:
            return ""
        counts = self.codec_counts()
        return "; ".join(
            f"{side.upper()} " + ", ".join(f"{c} x{n}" for c, n in sorted(counts[side].items())) for side in "kv"
        )

    def fitted(self, head_dim: int) -> KVSpec:
        """This spec for heads of head_dim channels: where a codec scales groups of a token's
        channels and the group does not divide the head (32 of 80), the group becomes the largest
        power of two that divides the head and is no larger (16): never coarser than asked."""

        def fit(group: int, codecs: list[Codec]) -> int:
            if head_dim <= 0 or not head_dim % group or not any(c.channel_groups for c in codecs):
                return group
            return min(head_dim & -head_dim, 1 << group.bit_length() - 1)  # head's largest 2^k divisor, <= group

        pairs = [(self.k, self.v), *self.layer_codecs]
        kgroup, vgroup = fit(self.kgroup, [k for k, _ in pairs]), fit(self.vgroup, [v for _, v in pairs])
        if (kgroup, vgroup) == (self.kgroup, self.vgroup):
            return self
        return replace(self, kgroup=kgroup, vgroup=vgroup, name="")

    def validate(self, head_dim: int, n_layers: int | None = None) -> None:
        if n_layers is not None and self.layer_codecs and len(self.layer_codecs) != n_layers:
            if self.name in maps():
                raise UserError(
                    f"--kv {self.name} is a map for a {len(self.layer_codecs)}-layer model (SmolLM2-135M); this one has "
                    f"{n_layers} layers: use k3v2auto (chosen per prompt) or make one with minillama kv allocate"
                )
            raise UserError(
                f"--kv layers= gives codecs for {len(self.layer_codecs)} layers; the model has {n_layers}: "
                f"give one K/V pair per layer"
            )
        for v in [self.v] + [v for _, v in self.layer_codecs]:
            v.validate(head_dim, self.vgroup)
        for k in [self.k] + [k for k, _ in self.layer_codecs]:
            k.validate(head_dim, self.kgroup)
            if self.rope == "pre" and k.rotate:
                raise UserError(
                    f"rope=pre needs an unrotated key codec, not {k.name}: the Hadamard rotation "
                    "does not commute with RoPE (use int4c, int4, int8, ...)"
                )
        if head_dim % 2:
            raise UserError(f"head_dim {head_dim} is odd: RoPE pairs channels")
        if self.auto:
            cheapest = CODECS[AUTO_CANDIDATES[0]]
            least = (cheapest.body_bits(head_dim, self.kgroup) + cheapest.body_bits(head_dim, self.vgroup)) / 2
            if self.auto < least - 1e-9:
                raise UserError(
                    f"--kv bits=auto:{self.auto:g} is below the cheapest choice ({least:.3f} bits an element with "
                    f"{AUTO_CANDIDATES[0]} everywhere at head_dim {head_dim}): raise it"
                )
        if self.tier:
            self.tier_codec.validate(head_dim, head_dim)
            if self.start:
                raise UserError("--kv tier= and start= do not go together: give one of them")
            bodies = {c for pair in [(self.k, self.v), *self.layer_codecs] for c in pair if c.quantized}
            for body in sorted(bodies, key=lambda c: c.name):
                if body.rotate != self.tier_codec.rotate:
                    twin = "an unrotated" if body.rotate is False else "a Hadamard (h)"
                    raise UserError(
                        f"--kv tier={self.tier}:{self.tier_codec.name} codes in the space of the body codec {body.name}, "
                        f"which is {'' if body.rotate else 'not '}rotated: give the tier {twin} codec"
                    )

    def __str__(self) -> str:
        return self.name or self.canonical()

    def canonical(self) -> str:
        """The spec in the grammar with every field spelled out: equal for equal specs, whatever
        name or order they were written with (a saved cache is matched by it)."""
        group = f"group={self.kgroup}" if self.kgroup == self.vgroup else f"kgroup={self.kgroup},vgroup={self.vgroup}"
        codecs = f"bits=auto:{self.auto:g}" if self.auto else f"k={self.k.name},v={self.v.name}"
        text = f"{codecs},{group},residual={self.residual},sinks={self.sinks}"
        extras = [
            ("center=1", self.center),
            ("rope=pre", self.rope == "pre"),
            ("positions=cache", self.positions == "cache"),
            (f"start={self.start}", self.start > 0),
            ("layers=" + ";".join(f"{k.name}/{v.name}" for k, v in self.layer_codecs), bool(self.layer_codecs)),
            (f"tier={self.tier}:{self.tier_codec.name if self.tier_codec else ''}", self.tier > 0),
        ]
        return text + "".join("," + e for e, on in extras if on)


PRESETS: dict[str, str] = {
    "fp32": "k=fp32,v=fp32",
    "bf16": "k=bf16,v=bf16",
    "fp16": "k=fp16,v=fp16",
    "int8": "k=int8,v=int8",
    "kivi4": "k=int4c,v=int4,group=32,residual=32",
    "kivi2": "k=int2c,v=int2,group=32,residual=32",
    "hadv2": "k=int4c,v=int2h,group=32,residual=32",
    "ternary": "k=int4c,v=tern,group=32,residual=32",
    "k4v3lmc": "k=lm4h,v=lm3h,group=64,residual=8,sinks=4,center=1",
    "k3v2auto": "bits=auto:2.73,group=64,residual=8,sinks=4,center=1,tier=56:lm4hb",
}

PRESET_NOTES: dict[str, str] = {
    "int8": "8-bit per-token keys and values: indistinguishable from fp16",
    "kivi4": "KIVI: per-channel int4 keys, per-token int4 values",
    "kivi2": "KIVI at 2 bits: what plain 2-bit values cost without a rotation",
    "hadv2": "KIVI int4 keys + Hadamard-rotated 2-bit values: the method minillama reproduces",
    "ternary": "KIVI int4 keys + ternary values: the method's failure case",
    "k4v3lmc": "~3.9 bits: centered Lloyd-Max 4-bit keys, 3-bit values, 8 exact tokens, 4 sinks",
    "k3v2auto": "~3.0 bits, any model: each layer's K/V among lm2hb/3hb/4hb chosen from the prompt",
}

MAPS_DIR = Path(__file__).parent / "maps"  # the default model's per-layer maps, one spec a file


def maps() -> dict[str, Path]:
    """The shipped maps by name (kv/maps/NAME.kv): specs with layers= for the default model."""
    return {path.stem: path for path in sorted(MAPS_DIR.glob("*.kv"))}


def read_map(path: Path) -> tuple[str, str]:
    """(spec, about) from a map file: '#' lines describe it (the first is its one-line summary),
    the one other line is the spec. A UserError when the file cannot be a map."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read the --kv map {shown(str(path))}: {e}") from None
    notes = [line[1:].strip() for line in text.splitlines() if line.startswith("#")]
    specs = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    if len(specs) != 1 or len(specs[0]) > 100_000:
        raise UserError(f"--kv map {shown(str(path))} must hold one spec line (and '#' comments), found {len(specs)}")
    return specs[0], notes[0] if notes else ""


GRAMMAR = (
    "k=CODEC,v=CODEC[,group=G][,kgroup=G][,vgroup=G][,residual=R][,sinks=S][,center=0|1]"
    "[,rope=post|pre][,positions=absolute|cache][,start=N][,layers=K/V;K/V;...][,tier=N:CODEC]"
    " | bits=auto:B[,group=G][,residual=R][,sinks=S][,center=0|1][,tier=N:CODEC]"
)
NUMBERS = ("group", "kgroup", "vgroup", "residual", "sinks", "center", "start")
WORDS = {"rope": ("post", "pre"), "positions": ("absolute", "cache")}
_FIELD = re.compile(r"^([a-z]+)=(.+)$")


def codec_named(name: str) -> Codec | None:
    """A registered codec, or one a parametric name spells (``lm3f2:24.33.15``: freq_blocks.py);
    None if neither."""
    return CODECS.get(name) or frequency_blocks(name)


def _nearest(name: str, names: list[str]) -> str:
    """ "did you mean X?" for the closest of `names` (difflib's ratio), else where the names are listed."""
    import difflib

    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    listing = "`minillama kv --list` lists them"
    return f"did you mean {' or '.join(close)}? ({listing})" if close else listing


def _choices(name: str, codecs_only: bool = False) -> str:
    names = list(CODECS) if codecs_only else list(dict.fromkeys([*PRESETS, *maps(), *CODECS]))
    return _nearest(name, names)


def named_spec(name: str) -> str | None:
    """The spec text of a preset, a shipped map or a map file's path; None for anything else."""
    if name in PRESETS:
        return PRESETS[name]
    if name in maps():
        return read_map(maps()[name])[0]
    if name.endswith(".kv") and "=" not in name:
        return read_map(Path(name))[0]
    return None


def parse_kv(text: str) -> KVSpec:
    """Parse a preset name, a map (kv/maps/NAME.kv or a path ending .kv) or a spec in the grammar
    above (GRAMMAR)."""
    text = text.strip()
    named = named_spec(text)
    if named is not None:
        spec = parse_kv(named)
        return KVSpec(**{**spec.__dict__, "name": text})
    first, _, changes = text.partition(",")
    base = named_spec(first.strip()) if "=" not in first else None
    if base is not None:  # a preset with fields changed: hadv2,sinks=4
        return _changed(first.strip(), base, changes, text)
    if "=" not in text:
        raise UserError(f"unknown --kv preset {shown(text)}: {_choices(text)}")
    fields: dict[str, str] = {}
    for item in text.split(","):
        m = _FIELD.match(item.strip())
        if not m or m.group(1) not in ("k", "v", "layers", "tier", "bits", *NUMBERS, *WORDS):
            raise UserError(  # the grammar alone: with every preset and codec the line outgrew a terminal's screen
                f"malformed --kv item {shown(item)}: expected {GRAMMAR} (`minillama kv --list` shows the presets and codecs)"
            )
        if m.group(1) in fields:  # k=int4,k=int2 would silently run the last one
            raise UserError(
                f"--kv names {m.group(1)}= twice ({m.group(1)}={shown(fields[m.group(1)])} and "
                f"{m.group(1)}={shown(m.group(2).strip())}): give each key once"
            )
        fields[m.group(1)] = m.group(2).strip()
    auto = _auto(fields) if "bits" in fields else 0.0
    if "layers" in fields:  # k= and v= default to the first layer's codecs
        first_pair = _layers(fields["layers"])[0]
        fields.setdefault("k", first_pair[0].name)
        fields.setdefault("v", first_pair[1].name)
    if "k" not in fields or "v" not in fields:
        raise UserError(f"--kv {shown(text)} must name both k= and v= codecs (`minillama kv --list` lists them)")
    for key in ("k", "v"):
        if key in fields and codec_named(fields[key]) is None:
            raise UserError(f"unknown codec {shown(fields[key])} for {key}=: {_choices(fields[key], True)}")
    k, v = codec_named(fields["k"]), codec_named(fields["v"])
    nums = {}
    for key in NUMBERS:
        if key in fields:
            if fields[key].startswith("-") and fields[key][1:].isascii() and fields[key][1:].isdigit():
                raise UserError(f"--kv {key}={fields[key]} must not be negative")
            if not (fields[key].isascii() and fields[key].isdigit()):  # int() also reads "３２"
                raise UserError(f"--kv {key}={shown(fields[key])} is not a whole number written in 0-9")
            nums[key] = int(fields[key])
    for key, allowed in WORDS.items():
        if key in fields and fields[key] not in allowed:
            raise UserError(f"--kv {key}={shown(fields[key])}: choose {' or '.join(allowed)}")
    group = nums.get("group", 32)
    kgroup, vgroup = nums.get("kgroup", group), nums.get("vgroup", group)
    if min(kgroup, vgroup) < 1:
        raise UserError("--kv group sizes must be at least 1")
    if nums.get("center", 0) > 1:
        raise UserError("--kv center must be 0 or 1")
    rope, positions = fields.get("rope", "post"), fields.get("positions", "absolute")
    if positions == "cache" and rope != "pre":
        raise UserError("--kv positions=cache needs rope=pre: keys stored after RoPE carry their old positions")
    layers = _layers(fields["layers"]) if "layers" in fields else ()
    quantized = k.quantized or v.quantized or any(c.quantized for pair in layers for c in pair)
    residual = nums.get("residual", 32 if quantized else 0)
    tier, tier_codec = _tier(fields["tier"], quantized) if "tier" in fields else (0, None)
    return KVSpec(
        k,
        v,
        kgroup,
        vgroup,
        residual,
        nums.get("sinks", 0),
        name=text if text not in PRESETS.values() else "",
        center=bool(nums.get("center", 0)),
        rope=rope,
        positions=positions,
        start=nums.get("start", 0),
        layer_codecs=layers,
        tier=tier,
        tier_codec=tier_codec,
        auto=auto,
    )


def _changed(preset: str, base: str, changes: str, text: str) -> KVSpec:
    """``PRESET,key=value,...``: the preset's spec `base` with those fields given anew (each once)."""
    fields = dict(item.split("=", 1) for item in base.split(","))
    given = [item.strip().partition("=")[0] for item in changes.split(",")]
    twice = sorted({key for key in given if given.count(key) > 1})
    if twice:
        raise UserError(f"--kv {shown(text)} names {twice[0]}= twice: give each key once")
    for item in changes.split(","):
        key, eq, value = item.strip().partition("=")
        if not eq:
            raise UserError(f"malformed --kv item {shown(item)} after the preset {preset}: expected key=value")
        fields[key] = value
    spec = parse_kv(",".join(f"{key}={value}" for key, value in fields.items()))
    return KVSpec(**{**spec.__dict__, "name": text})


def _auto(fields: dict[str, str]) -> float:
    """``bits=auto:B`` -> B, with k= and v= filled in as the costliest candidate (the cache chooses
    each layer's codecs at its first append, kv/auto.py). The options that name codecs are refused."""
    text = fields["bits"]
    kind, _, budget = text.partition(":")
    try:
        bits = float(budget)
    except ValueError:
        bits = float("nan")
    if kind != "auto" or not bits > 0 or bits == float("inf"):
        raise UserError(
            f"--kv bits={shown(text)}: write bits=auto:B, B the average bits an element (e.g. bits=auto:2.75)"
        )
    named = [key for key in ("k", "v") if key in fields]
    if named:
        raise UserError(
            f"--kv bits=auto chooses every layer's codecs among {', '.join(AUTO_CANDIDATES)}: drop {named[0]}="
        )
    fields["k"] = fields["v"] = AUTO_CANDIDATES[-1]
    return bits


def _tier(text: str, quantized: bool) -> tuple[int, Codec]:
    """``N:CODEC`` -> (N, the codec): N >= 1 tokens in a quantized per-token codec."""
    n, _, name = text.partition(":")
    if not (n.strip().isascii() and n.strip().isdigit()) or int(n) < 1 or not name.strip():
        raise UserError(f"--kv tier={shown(text)}: write tier=N:CODEC, N tokens of at least 1 (e.g. tier=56:lm4hb)")
    codec = codec_named(name.strip())
    if codec is None:
        raise UserError(f"unknown codec {shown(name.strip())} for tier=: {_choices(name.strip(), True)}")
    per_channel = codec.unit(2) != 1  # unit(G) is G for codecs that quantize along time
    if not codec.quantized or per_channel or codec.row_kind is None:
        raise UserError(
            f"--kv tier={shown(text)}: the tier needs a per-token quantized codec the kernels read "
            "(lm4hb, lm4h, int4h, int8, ...)"
        )
    if not quantized:
        raise UserError(f"--kv tier={shown(text)} needs a quantized body: every codec here keeps tokens exact")
    return int(n), codec


def _layers(text: str) -> tuple[tuple[Codec, Codec], ...]:
    """``K/V;K/V;...`` -> each layer's (K, V) codecs."""
    out = []
    for i, item in enumerate(text.split(";")):
        pair = item.strip().split("/")
        if len(pair) != 2 or any(codec_named(c) is None for c in pair):
            raise UserError(
                f"--kv layers= item {i} {shown(item)}: write one K/V pair of codecs per layer, e.g. layers=lm4h/lm3h;lm3h/lm2h "
                f"(codecs: {', '.join(CODECS)})"
            )
        out.append((codec_named(pair[0]), codec_named(pair[1])))
    return tuple(out)
