"""A mixed-precision spec from sensitivity maps: ``minillama kv allocate``.

    minillama ppl --dataset hamlet --sensitivity --kv k3v2lm --json > k3v2lm.json
    minillama ppl --dataset hamlet --sensitivity --kv k4v3lmc --json > k4v3lmc.json
    minillama kv allocate --map k3v2lm.json --map k4v3lmc.json --bits 3.0

Each map prices one codec per tensor (K or V) of every layer: its KLD when only that tensor is
quantized. Several maps of specs that differ only in their codecs give every tensor a few
priced choices; kv/allocate.py picks one per tensor under the budget (average bits per element
of the quantized body, codes and scales), and the result is the first map's spec with every
layer's codecs spelled out (``layers=``). A codec priced by two maps gets the mean of their
KLDs. The maps must share group sizes (the bits of a codec depend on them); other options
(centering, sinks, residual) are taken from the first map, and the note says where the maps
differ, since a price measured under other options is then an estimate.

With ``byte_scales`` every Lloyd-Max choice is replaced by its one-byte-scale twin (lm3h ->
lm3hb): the twin's bits, the map's price. That price is an estimate -- the byte's coarser scale
adds a few percent of KLD (docs/archive/frontiers.md, Frontier V) -- taken so that the freed bits can be
spent without new maps; the mix is then measured like any other.

Choose on one text, check on others: a mix made from maps of one text is evaluated on the
cached path of another before it is trusted (docs/quality.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from minillama.errors import UserError
from minillama.kv.allocate import Choice, allocate
from minillama.kv.codecs import byte_scale_twin
from minillama.kv.spec import KVSpec, parse_kv

OPTIONS = ("residual", "sinks", "center", "rope", "positions", "start")


@dataclass
class Allocation:
    spec: KVSpec  # the first map's spec with every layer's codecs
    bits: float  # average body bits per element of the choice
    cost: float  # the sum of the chosen tensors' map KLDs (an estimate of the whole's KLD)
    notes: list[str]


def map_spec(rows: list[dict], where: str) -> KVSpec:
    """The spec a sensitivity map was measured with (its rows' ``kv``), checked to be a map."""
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise UserError(
            f"{where} is not a sensitivity map: expected the JSON list `minillama ppl --sensitivity --json` prints"
        )
    names = {r.get("kv") for r in rows}
    if len(names) != 1 or None in names:
        raise UserError(f"{where} is not one sensitivity map: its rows name {len(names)} specs")
    if not any(r.get("layer") is not None and r.get("tensor") in ("k", "v") for r in rows):
        raise UserError(f"{where} has no per-layer rows: make it with minillama ppl --sensitivity --json")
    return parse_kv(names.pop())


def choices_from_maps(
    maps: list[tuple[str, list[dict]]], n_layers: int, head_dim: int, byte_scales: bool = False
) -> tuple[KVSpec, list[list[Choice]], list[str]]:
    """The first map's spec; per tensor (layer 0's K, layer 0's V, layer 1's K, ...) its priced
    codecs (with ``byte_scales``, the one-byte-scale twins where a codec has one); and notes."""
    specs = [map_spec(rows, where) for where, rows in maps]
    first = specs[0]
    notes = []
    for (where, _), s in zip(maps[1:], specs[1:]):
        if (s.kgroup, s.vgroup) != (first.kgroup, first.vgroup):
            raise UserError(
                f"{where} was measured with kgroup={s.kgroup},vgroup={s.vgroup}, the first map with "
                f"kgroup={first.kgroup},vgroup={first.vgroup}: a codec's bits depend on its group, give maps of one group size"
            )
        for name in OPTIONS:
            if getattr(s, name) != getattr(first, name):
                notes.append(f"{s} has {name}={getattr(s, name)}, the spec keeps {first}'s {getattr(first, name)}")
    priced: list[dict[str, list]] = [{} for _ in range(2 * n_layers)]  # codec name -> [codec, bits, [klds]]
    for (where, rows), s in zip(maps, specs):
        for r in rows:
            layer, tensor = r.get("layer"), r.get("tensor")
            if layer is None or tensor not in ("k", "v"):
                continue
            if not (isinstance(layer, int) and 0 <= layer < n_layers):
                raise UserError(f"{where} prices layer {layer!r}; the model has {n_layers} layers")
            t = 0 if tensor == "k" else 1
            codec, group, _ = s.tensors(layer)[t]
            codec = (byte_scale_twin(codec) or codec) if byte_scales else codec
            entry = priced[2 * layer + t].setdefault(codec.name, [codec, codec.body_bits(head_dim, group), []])
            entry[2].append(float(r["kld_mean"]))
    for j, p in enumerate(priced):
        if not p:
            raise UserError(f"no map prices layer {j // 2}'s {'KV'[j % 2]}: every map must cover every layer")
    choices = [[Choice(c, bits, sum(k) / len(k)) for c, bits, k in p.values()] for p in priced]
    return first, choices, notes


def allocate_from_maps(
    maps: list[tuple[str, list[dict]]], budget: float, n_layers: int, head_dim: int, byte_scales: bool = False
) -> Allocation:
    """The cheapest-in-KLD mix of the maps' codecs within `budget` bits per element (kv/allocate.py)."""
    first, choices, notes = choices_from_maps(maps, n_layers, head_dim, byte_scales)
    pick = allocate(choices, budget)
    chosen = [options[i] for options, i in zip(choices, pick)]
    layers = tuple((chosen[2 * i].codec, chosen[2 * i + 1].codec) for i in range(n_layers))
    spec = replace(first, layer_codecs=layers, name="")
    return Allocation(spec, sum(c.bits for c in chosen) / len(chosen), sum(c.cost for c in chosen), notes)
