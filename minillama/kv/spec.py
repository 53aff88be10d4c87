"""The ``--kv`` spec: which codec each tensor uses, and the cache's windows and options.

    --kv PRESET[,key=value...]
    --kv k=CODEC,v=CODEC[,group=G][,kgroup=G][,vgroup=G][,residual=R][,sinks=S][,center=0|1]
                        [,rope=post|pre][,positions=absolute|cache][,start=N]

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
* ``kfirst=CODEC,first=N``: the first N layers store keys with another codec (per-layer
  bits: the first layers of Llama models are the most sensitive to key error).
* ``layers=K/V;K/V;...``: every layer's (K, V) codecs, overriding ``k=`` and ``v=`` (mixed
  precision by layer; ``minillama kv allocate`` writes one from sensitivity maps, kv/allocate.py).
* ``tier=N:CODEC``: the N tokens just older than the exact residual are kept in a finer codec
  than the body (an age tier, kv/store.py): ``residual=8,tier=56:lm4hb`` keeps the newest 8
  exact and the 56 before them at 4 bits, the rest in each layer's body codec. The recent
  tokens are where attention looks most (docs/quality.md, Frontier XV).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from minillama.errors import UserError, shown
from minillama.kv.auto import CANDIDATES as AUTO_CANDIDATES
from minillama.kv.codecs import CODECS, Codec
from minillama.kv.freq_blocks import frequency_blocks
from minillama.kv.outliers import outlier_codec, with_outliers


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
    kfirst: Codec | None = None  # the key codec of the first `first` layers (per-layer bits), else k
    first: int = 0
    # Every layer's (K, V) codecs, overriding k, v and kfirst: mixed precision by layer (the
    # sensitivity map quantizes one tensor of one layer; eval/sensitivity.py). Not in the grammar.
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
        keys = [self.k] + ([self.kfirst] if self.kfirst else []) + [k for k, _ in self.layer_codecs]
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
        """(codec, group, centered) for K, then V, of this layer (-1: past the first layers)."""
        if self.layer_codecs and 0 <= layer < len(self.layer_codecs):
            k, v = self.layer_codecs[layer]
            return [(k, self.kgroup, self.center), (v, self.vgroup, False)]
        k = self.kfirst if self.kfirst is not None and 0 <= layer < self.first else self.k
        return [(k, self.kgroup, self.center), (self.v, self.vgroup, False)]

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

    def validate(self, head_dim: int, n_layers: int | None = None) -> None:
        if n_layers is not None and self.kfirst is not None and self.first > n_layers:
            raise UserError(
                f"--kv first={self.first} names more layers than the model's {n_layers}: give first=1..{n_layers}"
            )
        if n_layers is not None and self.layer_codecs and len(self.layer_codecs) != n_layers:
            if self.name in MIXES:
                raise UserError(
                    f"--kv {self.name} is a mix for a {len(self.layer_codecs)}-layer model (SmolLM2-135M); this one has "
                    f"{n_layers} layers: use k3v2auto (chosen per prompt) or make one with minillama kv allocate"
                )
            raise UserError(
                f"--kv layers= gives codecs for {len(self.layer_codecs)} layers; the model has {n_layers}: "
                f"give one K/V pair per layer"
            )
        for v in [self.v] + [v for _, v in self.layer_codecs]:
            v.validate(head_dim, self.vgroup)
        for k in [self.k] + ([self.kfirst] if self.kfirst else []) + [k for k, _ in self.layer_codecs]:
            k.validate(head_dim, self.kgroup)
            if self.rope == "pre" and k.rotate:
                raise UserError(
                    f"rope=pre needs an unrotated key codec, not {k.name}: the Hadamard rotation "
                    "does not commute with RoPE (use int4c, int4, int4cs, nuq4, ...)"
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
            bodies |= {self.kfirst} if self.kfirst is not None and self.kfirst.quantized else set()
            for body in sorted(bodies, key=lambda c: c.name):
                if body.rotate != self.tier_codec.rotate:
                    twin = "an unrotated" if body.rotate is False else "a Hadamard (h)"
                    raise UserError(
                        f"--kv tier={self.tier}:{self.tier_codec.name} codes in the space of the body codec {body.name}, "
                        f"which is {'' if body.rotate else 'not '}rotated: give the tier {twin} codec"
                    )
                if body.per_sequence:
                    raise UserError(f"--kv tier= cannot sit beside {body.name}: its ranges are fitted per sequence")

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
            (f"kfirst={self.kfirst.name if self.kfirst else ''},first={self.first}", self.kfirst is not None),
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
    # Frontier presets (see docs/quality.md's ablation): exact attention sinks, rotated keys,
    # 3-bit rotated values, Lloyd-Max codebooks.
    "kivi4s": "k=int4c,v=int4,group=32,residual=32,sinks=4",
    "hadv2s": "k=int4c,v=int2h,group=32,residual=32,sinks=4",
    "k4v3h": "k=int4h,v=int3h,group=64,residual=32,sinks=4",
    "k4v3lm": "k=int4h,v=lm3h,group=64,residual=32,sinks=4",
    "k3v2lm": "k=lm3h,v=lm2h,group=64,residual=8,sinks=4",
    # Centered keys (center=1): the winners of the second round.
    "k4v3hc": "k=int4h,v=int3h,group=64,residual=32,sinks=4,center=1",
    "k4v3lmc": "k=lm4h,v=lm3h,group=64,residual=8,sinks=4,center=1",
    "k4v4lmc": "k=lm4h,v=lm4h,group=64,residual=8,sinks=4,center=1",
    # Each layer's codecs chosen per sequence from its prefill (kv/auto.py), at k3v2mixt's budget:
    # the 3-bit point for a model with no map (docs/quality.md, Frontier XXII).
    "k3v2auto": "bits=auto:2.73,group=64,residual=8,sinks=4,center=1,tier=56:lm4hb",
}


# Per-layer mixes for the default model (SmolLM2-135M, 30 layers), written by `minillama kv
# allocate` from its sensitivity maps on Hamlet (bench/results/sensitivity_{k4v4lmc,k4v3lmc,
# k3v2lm,k2v2lmc}_hamlet_w1.json, in that order; docs/quality.md): one K/V pair per layer, so a model with another
# layer count refuses them. Checked on wikitext-2, a text the maps never saw.
MIXES: dict[str, str] = {
    # --bits 2.3: lm2h keys (lm3h in 3 layers), lm2h values
    "k2v2mix": "k=lm2h,v=lm2h,group=64,residual=8,sinks=4,center=1,layers="
    "lm2h/lm2h;lm2h/lm2h;lm2h/lm2h;lm2h/lm2h;lm2h/lm2h;lm3h/lm2h;lm2h/lm2h;lm2h/lm2h;lm3h/lm2h;lm2h/lm2h;"
    "lm2h/lm2h;lm2h/lm2h;lm2h/lm2h;lm2h/lm2h;lm2h/lm2h;lm2h/lm2h;lm2h/lm2h;lm2h/lm2h;lm2h/lm2h;lm2h/lm2h;"
    "lm3h/lm2h;lm2h/lm2h;lm2h/lm2h;lm2h/lm2h;lm2h/lm2h;lm2h/lm2h;lm2h/lm2h;lm2h/lm2h;lm2h/lm2h;lm2h/lm2h",
    # --bits 2.81: keys lm2h / lm3h / lm4h in 14 / 8 / 8 layers, values lm2h / lm3h in 21 / 9
    "k3v2mix": "k=lm3h,v=lm2h,group=64,residual=8,sinks=4,center=1,layers="
    "lm2h/lm3h;lm3h/lm3h;lm2h/lm2h;lm3h/lm2h;lm3h/lm2h;lm3h/lm3h;lm3h/lm2h;lm3h/lm2h;lm4h/lm3h;lm3h/lm2h;"
    "lm3h/lm2h;lm2h/lm2h;lm2h/lm2h;lm2h/lm2h;lm4h/lm3h;lm4h/lm2h;lm2h/lm2h;lm4h/lm3h;lm4h/lm2h;lm2h/lm2h;"
    "lm4h/lm3h;lm2h/lm2h;lm2h/lm2h;lm4h/lm3h;lm4h/lm3h;lm2h/lm2h;lm2h/lm2h;lm2h/lm2h;lm2h/lm2h;lm2h/lm2h",
    # --bits 3.81: keys lm4h (lm2h in one layer), values lm3h / lm4h / lm2h in 17 / 9 / 4
    "k4v3mix": "k=lm4h,v=lm3h,group=64,residual=8,sinks=4,center=1,layers="
    "lm4h/lm4h;lm4h/lm4h;lm4h/lm3h;lm4h/lm3h;lm4h/lm4h;lm4h/lm3h;lm4h/lm3h;lm4h/lm3h;lm4h/lm4h;lm4h/lm3h;"
    "lm4h/lm3h;lm4h/lm2h;lm4h/lm3h;lm4h/lm3h;lm4h/lm3h;lm4h/lm3h;lm4h/lm3h;lm4h/lm4h;lm4h/lm4h;lm4h/lm3h;"
    "lm4h/lm4h;lm4h/lm3h;lm4h/lm2h;lm4h/lm4h;lm4h/lm4h;lm4h/lm2h;lm4h/lm3h;lm2h/lm2h;lm4h/lm3h;lm4h/lm3h",
    # The same maps with one-byte log scales (kv allocate --byte-scales): every codec's lm*hb twin,
    # the freed 1/8 bit an element spent on more layers at more bits.
    # --bits 2.3 --byte-scales: keys lm2hb / lm3hb / lm4hb in 22 / 7 / 1 layers, values lm2hb (lm3hb in one)
    "k2v2mixb": "k=lm2hb,v=lm2hb,group=64,residual=8,sinks=4,center=1,layers="
    "lm2hb/lm2hb;lm2hb/lm3hb;lm2hb/lm2hb;lm2hb/lm2hb;lm3hb/lm2hb;lm3hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb;lm3hb/lm2hb;lm3hb/lm2hb;"
    "lm2hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb;lm3hb/lm2hb;lm3hb/lm2hb;lm2hb/lm2hb;"
    "lm3hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb;lm4hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb",
    # --bits 2.81 --byte-scales: keys lm2hb / lm3hb / lm4hb in 11 / 7 / 12 layers, values lm2hb / lm3hb in 20 / 10
    "k3v2mixb": "k=lm3hb,v=lm2hb,group=64,residual=8,sinks=4,center=1,layers="
    "lm2hb/lm3hb;lm3hb/lm3hb;lm2hb/lm2hb;lm3hb/lm2hb;lm3hb/lm2hb;lm3hb/lm3hb;lm3hb/lm2hb;lm3hb/lm2hb;lm4hb/lm3hb;lm3hb/lm2hb;"
    "lm4hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb;lm4hb/lm3hb;lm4hb/lm2hb;lm2hb/lm2hb;lm4hb/lm3hb;lm4hb/lm2hb;lm4hb/lm2hb;"
    "lm4hb/lm3hb;lm4hb/lm3hb;lm2hb/lm2hb;lm4hb/lm3hb;lm4hb/lm3hb;lm2hb/lm2hb;lm4hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb",
    # --bits 3.81 --byte-scales: keys lm4hb, values lm3hb / lm4hb / lm2hb in 15 / 13 / 2
    "k4v3mixb": "k=lm4hb,v=lm3hb,group=64,residual=8,sinks=4,center=1,layers="
    "lm4hb/lm4hb;lm4hb/lm4hb;lm4hb/lm3hb;lm4hb/lm3hb;lm4hb/lm4hb;lm4hb/lm3hb;lm4hb/lm3hb;lm4hb/lm4hb;lm4hb/lm4hb;lm4hb/lm3hb;"
    "lm4hb/lm3hb;lm4hb/lm2hb;lm4hb/lm3hb;lm4hb/lm3hb;lm4hb/lm4hb;lm4hb/lm4hb;lm4hb/lm3hb;lm4hb/lm4hb;lm4hb/lm4hb;lm4hb/lm3hb;"
    "lm4hb/lm4hb;lm4hb/lm4hb;lm4hb/lm3hb;lm4hb/lm4hb;lm4hb/lm4hb;lm4hb/lm2hb;lm4hb/lm3hb;lm4hb/lm3hb;lm4hb/lm3hb;lm4hb/lm3hb",
    # --bits 2.73 --byte-scales, then the 56 tokens before the newest 8 in lm4hb (tier=56:lm4hb): 3.00
    # bits an element at N 896 (2.85 at 2048); keys lm2hb x13 / lm3hb x7 / lm4hb x10, values lm2hb x21 / lm3hb x9
    "k3v2mixt": "k=lm4h,v=lm4h,group=64,residual=8,sinks=4,center=1,tier=56:lm4hb,layers="
    "lm2hb/lm3hb;lm3hb/lm3hb;lm2hb/lm2hb;lm3hb/lm2hb;lm3hb/lm2hb;lm3hb/lm3hb;lm3hb/lm2hb;lm3hb/lm2hb;lm4hb/lm3hb;lm3hb/lm2hb;"
    "lm4hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb;lm4hb/lm3hb;lm4hb/lm2hb;lm2hb/lm2hb;lm4hb/lm3hb;lm4hb/lm2hb;lm2hb/lm2hb;"
    "lm4hb/lm3hb;lm4hb/lm2hb;lm2hb/lm2hb;lm4hb/lm3hb;lm4hb/lm3hb;lm2hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb",
    # bench/freq_blocks_ppl.py --frontier 2.185 --vq --tier 56:lm4hb: kv allocate at 2.185 body bits (byte
    # scales) over the four Hamlet maps and vq2hs values' map, every key choice offered also as 2 RoPE-
    # frequency blocks (widths chosen on Hamlet), then the tier: 2.50 bits an element at N 896; keys
    # lm2hb x16 / lm3hb x2 / lm2f2 x12, values lm2hb (vq2hs in one layer)
    "k2v2mixft": "k=lm2hb,v=lm2hb,group=64,residual=8,sinks=4,center=1,tier=56:lm4hb,layers="
    "lm2hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb;lm2f2:22.22.22/lm2hb;lm3hb/lm2hb;"
    "lm2hb/lm2hb;lm2f2:22.13.13/lm2hb;lm3hb/vq2hs;lm2f2:22.22.22/lm2hb;lm2f2:22.22.22/lm2hb;lm2hb/lm2hb;"
    "lm2hb/lm2hb;lm2hb/lm2hb;lm2f2:13.13.13/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb;lm2f2:13.04.22/lm2hb;"
    "lm2f2:22.22.04/lm2hb;lm2hb/lm2hb;lm2f2:13.04.13/lm2hb;lm2f2:13.13.13/lm2hb;lm2hb/lm2hb;lm2f2:13.13.13/lm2hb;"
    "lm2f2:04.22.04/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb;lm2hb/lm2hb",
}

PRESET_NOTES: dict[str, str] = {
    "hadv2": "KIVI int4 keys + Hadamard-rotated 2-bit values (the method minillama reproduces)",
    "kivi4": "KIVI: per-channel int4 keys, per-token int4 values",
    "kivi2": "KIVI: per-channel int2 keys, per-token int2 values",
    "ternary": "KIVI int4 keys + ternary values",
    "kivi4s": "kivi4 + the first 4 tokens kept exact (attention sinks)",
    "hadv2s": "hadv2 + the first 4 tokens kept exact (attention sinks)",
    "k4v3h": "Hadamard int4 keys, Hadamard int3 values, group 64, 4 sinks",
    "k4v3lm": "Hadamard int4 keys, Hadamard Lloyd-Max 3-bit values, group 64, 4 sinks",
    "k3v2lm": "Hadamard Lloyd-Max 3-bit keys and 2-bit values, group 64, residual 8, 4 sinks",
    "k4v3hc": "k4v3h with centered keys (per-sequence channel mean subtracted)",
    "k4v3lmc": "Lloyd-Max 4-bit keys (centered) and 3-bit values, group 64, residual 8, 4 sinks",
    "k4v4lmc": "Lloyd-Max 4-bit keys (centered) and 4-bit values, group 64, residual 8, 4 sinks",
    "k3v2auto": "~3.0 bits, any model: each layer's K/V among lm2hb/3hb/4hb chosen from the prompt, tier 56 at 4",
    "k2v2mix": "~2.5 bits: Lloyd-Max keys 2/3-bit, values 2-bit by layer (kv allocate; SmolLM2-135M)",
    "k3v2mix": "~3.0 bits: Lloyd-Max keys 2/3/4-bit, values 2/3-bit by layer (kv allocate; SmolLM2-135M)",
    "k4v3mix": "~4.0 bits: Lloyd-Max keys 2/4-bit, values 2/3/4-bit by layer (kv allocate; SmolLM2-135M)",
    "k2v2mixb": "~2.5 bits: k2v2mix's maps with one-byte scales, 1/8 bit more for codes (kv allocate --byte-scales)",
    "k3v2mixb": "~3.0 bits: k3v2mix's maps with one-byte scales, 1/8 bit more for codes (kv allocate --byte-scales)",
    "k4v3mixb": "~4.0 bits: k4v3mix's maps with one-byte scales, 1/8 bit more for codes (kv allocate --byte-scales)",
    "k3v2mixt": "~3.0 bits: a 2.73-bit allocation with one-byte scales, the 56 tokens before the newest 8 at 4 bits",
    "k2v2mixft": "~2.5 bits: 2-bit keys (12 layers in two RoPE-frequency blocks) and values, the 56 before the newest 8 at 4",
}

GRAMMAR = (
    "k=CODEC,v=CODEC[,group=G][,kgroup=G][,vgroup=G][,residual=R][,sinks=S][,center=0|1]"
    "[,rope=post|pre][,positions=absolute|cache][,start=N][,kfirst=CODEC,first=N]"
    "[,layers=K/V;K/V;...][,tier=N:CODEC][,outliers=N][,koutliers=N][,voutliers=N]"
    " | bits=auto:B[,group=G][,residual=R][,sinks=S][,center=0|1][,tier=N:CODEC]"
)
NUMBERS = ("group", "kgroup", "vgroup", "residual", "sinks", "center", "start", "first")
NUMBERS += ("outliers", "koutliers", "voutliers")  # exact entries a row (kv/outliers.py)
WORDS = {"rope": ("post", "pre"), "positions": ("absolute", "cache")}
_FIELD = re.compile(r"^([a-z]+)=(.+)$")


def codec_named(name: str) -> Codec | None:
    """A registered codec, or one a parametric name spells (``lm3f2:24.33.15``: freq_blocks.py);
    None if neither."""
    return CODECS.get(name) or frequency_blocks(name) or outlier_codec(name)


def _choices() -> str:
    return (
        f"presets: {', '.join([*PRESETS, *MIXES])}; codecs: {', '.join(CODECS)}, "
        "lm{b}f{nb}:{widths} (frequency blocks), {codec}o{N} (outliers)"
    )


def parse_kv(text: str) -> KVSpec:
    """Parse a preset name or a spec in the grammar above (GRAMMAR)."""
    text = text.strip()
    if text in PRESETS or text in MIXES:
        spec = parse_kv(PRESETS.get(text) or MIXES[text])
        return KVSpec(**{**spec.__dict__, "name": text})
    first, _, changes = text.partition(",")
    if first.strip() in PRESETS or first.strip() in MIXES:  # a preset with fields changed: hadv2,sinks=4
        return _changed(first.strip(), changes, text)
    if "=" not in text:
        raise UserError(f"unknown --kv preset {shown(text)} ({_choices()})")
    fields: dict[str, str] = {}
    for item in text.split(","):
        m = _FIELD.match(item.strip())
        if not m or m.group(1) not in ("k", "v", "kfirst", "layers", "tier", "bits", *NUMBERS, *WORDS):
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
        if "kfirst" in fields:
            raise UserError("--kv layers= names every layer's codecs: drop kfirst= and first=")
    if "k" not in fields or "v" not in fields:
        raise UserError(f"--kv {shown(text)} must name both k= and v= codecs ({_choices()})")
    if ("kfirst" in fields) != ("first" in fields):
        raise UserError("--kv kfirst=CODEC and first=N go together: the key codec of the first N layers")
    for key in ("k", "v", "kfirst"):
        if key in fields and codec_named(fields[key]) is None:
            raise UserError(f"unknown codec {shown(fields[key])} for {key}= ({_choices()})")
    k, v = codec_named(fields["k"]), codec_named(fields["v"])
    nums = {}
    for key in NUMBERS:
        if key in fields:
            try:
                nums[key] = int(fields[key])
            except ValueError:
                raise UserError(f"--kv {key}={shown(fields[key])} is not a whole number") from None
            if nums[key] < 0:
                raise UserError(f"--kv {key}={nums[key]} must not be negative")
    for key, allowed in WORDS.items():
        if key in fields and fields[key] not in allowed:
            raise UserError(f"--kv {key}={shown(fields[key])}: choose {' or '.join(allowed)}")
    group = nums.get("group", 32)
    kgroup, vgroup = nums.get("kgroup", group), nums.get("vgroup", group)
    if min(kgroup, vgroup) < 1:
        raise UserError("--kv group sizes must be at least 1")
    if "first" in nums and nums["first"] < 1:
        raise UserError("--kv first=0 gives no layer the kfirst codec: first=N needs N >= 1")
    if nums.get("center", 0) > 1:
        raise UserError("--kv center must be 0 or 1")
    rope, positions = fields.get("rope", "post"), fields.get("positions", "absolute")
    if positions == "cache" and rope != "pre":
        raise UserError("--kv positions=cache needs rope=pre: keys stored after RoPE carry their old positions")
    kfirst = codec_named(fields["kfirst"]) if "kfirst" in fields else None
    layers = _layers(fields["layers"]) if "layers" in fields else ()
    quantized = k.quantized or v.quantized or (kfirst is not None and kfirst.quantized)
    quantized = quantized or any(c.quantized for pair in layers for c in pair)
    residual = nums.get("residual", 32 if quantized else 0)
    tier, tier_codec = _tier(fields["tier"], quantized) if "tier" in fields else (0, None)
    kout, vout = nums.get("koutliers", nums.get("outliers", 0)), nums.get("voutliers", nums.get("outliers", 0))
    if kout or vout:  # every quantized codec of the tensor, layer by layer
        k, v = _sparse(k, kout), _sparse(v, vout)
        kfirst = _sparse(kfirst, kout) if kfirst is not None else None
        layers = tuple((_sparse(a, kout), _sparse(b, vout)) for a, b in layers)
    return KVSpec(
        k,
        v,
        kgroup,
        vgroup,
        residual,
        nums.get("sinks", 0),
        name=text if text not in PRESETS.values() and text not in MIXES.values() else "",
        center=bool(nums.get("center", 0)),
        rope=rope,
        positions=positions,
        start=nums.get("start", 0),
        kfirst=kfirst,
        first=nums.get("first", 0),
        layer_codecs=layers,
        tier=tier,
        tier_codec=tier_codec,
        auto=auto,
    )


def _changed(preset: str, changes: str, text: str) -> KVSpec:
    """``PRESET,key=value,...``: the preset's spec with those fields given anew (each once)."""
    fields = dict(item.split("=", 1) for item in (PRESETS.get(preset) or MIXES[preset]).split(","))
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
    named = [key for key in ("k", "v", "kfirst", "first", "outliers", "koutliers", "voutliers") if key in fields]
    if named:
        raise UserError(
            f"--kv bits=auto chooses every layer's codecs among {', '.join(AUTO_CANDIDATES)}: drop {named[0]}="
        )
    fields["k"] = fields["v"] = AUTO_CANDIDATES[-1]
    return bits


def _sparse(codec: Codec, count: int) -> Codec:
    """`codec` with `count` exact entries a row (kv/outliers.py) where it quantizes at all."""
    return with_outliers(codec, count) if count and codec.quantized else codec


def _tier(text: str, quantized: bool) -> tuple[int, Codec]:
    """``N:CODEC`` -> (N, the codec): N >= 1 tokens in a quantized per-token codec."""
    n, _, name = text.partition(":")
    if not n.strip().isdigit() or int(n) < 1 or not name.strip():
        raise UserError(f"--kv tier={shown(text)}: write tier=N:CODEC, N tokens of at least 1 (e.g. tier=56:lm4hb)")
    codec = codec_named(name.strip())
    if codec is None:
        raise UserError(f"unknown codec {shown(name.strip())} for tier= ({_choices()})")
    per_channel = codec.unit(2) != 1  # unit(G) is G for codecs that quantize along time
    if not codec.quantized or per_channel or codec.per_sequence or codec.row_kind is None:
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
