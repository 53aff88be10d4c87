"""Mixed precision by layer: ``layers=`` specs, the greedy allocation (kv/allocate.py) and the
spec it makes from sensitivity maps (eval/allocation.py, ``minillama kv allocate``).

A ``layers=`` spec names every layer's K and V codec; its bits are the per-layer codecs' bits
averaged, the cache holds exactly those bytes, and the kernels read each layer with its own
codec. The allocation spends a budget of bits where the maps say a tensor loses the most."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from minillama.app.cli import cli
from minillama.errors import UserError
from minillama.eval.allocation import allocate_from_maps
from minillama.eval.synthetic import fill_synthetic
from minillama.kv.allocate import Choice, allocate
from minillama.kv.budget import formula_live_bytes
from minillama.kv.cache import KVCache
from minillama.kv.codecs import CODECS
from minillama.kv.spec import parse_kv
from minillama.native import backend

MIXED = "k=lm3h,v=lm2h,group=64,residual=0,layers=lm4h/lm3h;lm3h/lm2h"


def test_a_layers_spec_names_every_layer_and_reads_back_from_its_canonical_form():
    spec = parse_kv(MIXED)
    assert [(k.name, v.name) for k, v in spec.layer_codecs] == [("lm4h", "lm3h"), ("lm3h", "lm2h")]
    assert [spec.tensors(i)[0][0].name for i in range(2)] == ["lm4h", "lm3h"]
    assert parse_kv(spec.canonical()).canonical() == spec.canonical()
    # k= and v= default to the first layer's codecs
    assert (
        parse_kv("layers=int4/int2;int2/int2,group=64").canonical()
        == parse_kv("k=int4,v=int2,group=64,layers=int4/int2;int2/int2").canonical()
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("k=lm3h,v=lm2h,layers=lm3h/lm2h;lm9h/lm2h", "layers= item 1"),
        ("k=lm3h,v=lm2h,layers=lm3h", "one K/V pair of codecs per layer"),
        ("layers=lm3h/lm2h,first=1", "malformed"),
    ],
)
def test_a_malformed_layers_spec_is_refused_in_one_line(text, message):
    with pytest.raises(UserError, match=message):
        parse_kv(text)


def test_a_layers_spec_must_give_every_layer():
    with pytest.raises(UserError, match="codecs for 2 layers; the model has 3"):
        KVCache(parse_kv(MIXED), 3, 2, 64, 256)


def test_the_bits_of_a_mixed_spec_are_its_layers_bits_averaged():
    """Lloyd-Max codes of b bits + one float16 scale per 64 channels: b + 16/64 bits a value.
    Layer 0 stores 4 and 3 bits, layer 1 3 and 2: (4.25 + 3.25 + 3.25 + 2.25) / 4 = 3.25."""
    spec = parse_kv(MIXED)
    cache = KVCache(spec, 2, 2, 64, 256)
    fill_synthetic(cache, 128)
    assert cache.bits_per_element() == pytest.approx(3.25)
    assert sum(formula_live_bytes(2, 2, 64, spec, 128).values()) == sum(cache.live_bytes().values())
    assert [CODECS[c].body_bits(64, 64) for c in ("lm2h", "lm3h", "lm4h")] == [2.25, 3.25, 4.25]


def priced(*rows: tuple[float, float]) -> list[Choice]:
    return [Choice(CODECS["int4"], bits, cost) for bits, cost in rows]


def test_the_greedy_takes_the_upgrade_that_removes_most_loss_per_bit():
    # Tensor 0 gains 0.9 for one bit, tensor 1 gains 0.5: with room for one upgrade, tensor 0 gets it.
    choices = [priced((2, 1.0), (3, 0.1)), priced((2, 0.6), (3, 0.1))]
    assert allocate(choices, 2.5) == [1, 0]
    assert allocate(choices, 3.0) == [1, 1]
    assert allocate(choices, 2.0) == [0, 0]
    # A bigger step can be worth more per bit than the small one before it.
    assert allocate([priced((2, 1.0), (3, 0.9), (4, 0.0))], 4.0) == [2]


def test_the_allocation_stays_within_budget_and_is_deterministic():
    g = torch.Generator().manual_seed(0)
    costs = torch.rand(40, 3, generator=g).sort(dim=1, descending=True).values.tolist()
    choices = [priced((2.25, c[0]), (3.25, c[1]), (4.25, c[2])) for c in costs]
    for budget in (2.25, 2.6, 3.0, 3.7, 4.25, 9.0):
        pick = allocate(choices, budget)
        assert pick == allocate(choices, budget)
        assert sum(c[i].bits for c, i in zip(choices, pick)) / len(choices) <= budget + 1e-9
    with pytest.raises(UserError, match="below the cheapest choice"):
        allocate(choices, 2.0)


def sensitivity_map(spec: str, klds: dict[tuple[int, str], float]) -> list[dict]:
    rows = [{"kv": spec, "layer": i, "tensor": t, "kld_mean": x, "ppl": 1.0} for (i, t), x in klds.items()]
    return rows + [{"kv": spec, "layer": None, "tensor": "all", "kld_mean": sum(klds.values()), "ppl": 1.0}]


LOW = sensitivity_map(
    "k=lm3h,v=lm2h,group=64,residual=8,sinks=4", {(0, "k"): 0.02, (0, "v"): 0.01, (1, "k"): 0.001, (1, "v"): 0.04}
)
HIGH = sensitivity_map(
    "k=lm4h,v=lm3h,group=64,residual=8,sinks=4", {(0, "k"): 0.002, (0, "v"): 0.001, (1, "k"): 0.0005, (1, "v"): 0.004}
)


def test_maps_price_each_tensor_and_the_budget_goes_where_they_lose_most():
    # From (lm3h, lm2h) everywhere: 2.75 bits. One more bit per tensor at 3.0 bits buys one
    # upgrade: layer 1's values lose 0.036 less at lm3h, the largest gain.
    a = allocate_from_maps([("low", LOW), ("high", HIGH)], 3.0, 2, 64)
    assert [(k.name, v.name) for k, v in a.spec.layer_codecs] == [("lm3h", "lm2h"), ("lm3h", "lm3h")]
    assert a.bits == pytest.approx(3.0) and a.cost == pytest.approx(0.02 + 0.01 + 0.001 + 0.004)
    assert (a.spec.residual, a.spec.sinks, a.spec.kgroup) == (8, 4, 64)  # the first map's spec
    cheapest = allocate_from_maps([("low", LOW), ("high", HIGH)], 2.75, 2, 64)
    assert [(k.name, v.name) for k, v in cheapest.spec.layer_codecs] == [("lm3h", "lm2h")] * 2


def test_with_byte_scales_the_freed_bits_buy_more_upgrades():
    """--byte-scales: every Lloyd-Max choice becomes its one-byte-scale twin (b + 8/64 bits, not
    b + 16/64) at its map's price. At 3.125 bits the fp16 scales start at 2.75 and afford one
    upgrade (layer 1's values, 0.036 removed per bit); the byte scales start at 2.625 and afford
    that and the next best, layer 0's keys (0.018 per bit): 3.125 bits."""
    maps = [("low", LOW), ("high", HIGH)]
    fp16 = allocate_from_maps(maps, 3.125, 2, 64)
    assert [(k.name, v.name) for k, v in fp16.spec.layer_codecs] == [("lm3h", "lm2h"), ("lm3h", "lm3h")]
    a = allocate_from_maps(maps, 3.125, 2, 64, byte_scales=True)
    assert [(k.name, v.name) for k, v in a.spec.layer_codecs] == [("lm4hb", "lm2hb"), ("lm3hb", "lm3hb")]
    assert a.bits == pytest.approx((4.125 + 2.125 + 3.125 + 3.125) / 4)
    assert a.cost == pytest.approx(0.002 + 0.01 + 0.001 + 0.004) and a.cost < fp16.cost
    assert allocate_from_maps(maps, 3.125, 2, 64, byte_scales=True) == a  # deterministic
    cache = KVCache(a.spec, 2, 2, 64, 256)
    fill_synthetic(cache, 128)
    assert cache.layers[0][0].body["scale"].buf.dtype == torch.uint8  # one byte a scale, held and counted
    assert sum(formula_live_bytes(2, 2, 64, a.spec, 128).values()) == sum(cache.live_bytes().values())


def test_maps_of_other_group_sizes_or_other_files_are_refused():
    other = sensitivity_map("k=lm4h,v=lm3h,group=32", {(0, "k"): 0.1, (0, "v"): 0.1, (1, "k"): 0.1, (1, "v"): 0.1})
    with pytest.raises(UserError, match="a codec's bits depend on its group"):
        allocate_from_maps([("low", LOW), ("other", other)], 3.0, 2, 64)
    with pytest.raises(UserError, match="not a sensitivity map"):
        allocate_from_maps([("x", {"kv": "k4v3lmc"})], 3.0, 2, 64)
    with pytest.raises(UserError, match="every map must cover every layer"):
        allocate_from_maps([("low", LOW)], 3.0, 3, 64)


def test_kv_allocate_prints_a_spec_that_runs(tiny_dir, tmp_path):
    paths = []
    for name, rows in (("low", LOW), ("high", HIGH)):
        paths += ["--map", str(tmp_path / f"{name}.json")]
        (tmp_path / f"{name}.json").write_text(json.dumps(rows))
    result = CliRunner().invoke(cli, ["kv", "allocate", "--model", str(tiny_dir), *paths, "--bits", "3.0"])
    assert result.exit_code == 0, result.output
    spec = parse_kv(result.stdout.strip().splitlines()[-1])
    assert [(k.name, v.name) for k, v in spec.layer_codecs] == [("lm3h", "lm2h"), ("lm3h", "lm3h")]
    info = json.loads(
        CliRunner().invoke(cli, ["kv", "allocate", "--model", str(tiny_dir), *paths, "--bits", "3", "--json"]).stdout
    )
    assert info["body_bits"] == pytest.approx(3.0) and info["counts"]["v"] == {"lm2h": 1, "lm3h": 1}
    byte = CliRunner().invoke(cli, ["kv", "allocate", "--model", str(tiny_dir), *paths, "--bits", "3", "--byte-scales"])
    counts = parse_kv(byte.stdout.splitlines()[-1]).codec_counts()
    assert byte.exit_code == 0 and set(counts["k"]) | set(counts["v"]) <= {"lm2hb", "lm3hb", "lm4hb"}
    misplaced = CliRunner().invoke(cli, ["kv", "hadv2", "--byte-scales"])
    assert misplaced.exit_code != 0 and "--byte-scales and --out go with allocate" in misplaced.stderr


def test_kv_allocate_writes_a_map_that_kv_reads_by_its_path(tiny_dir, tmp_path):
    """--out FILE.kv: the spec as a map file (a '#' line says what it is), which --kv FILE.kv reads
    back as the same layers; a file that is not a map is refused and left as it was."""
    (tmp_path / "low.json").write_text(json.dumps(LOW))
    out = tmp_path / "mine.kv"
    args = ["kv", "allocate", "--model", str(tiny_dir), "--map", str(tmp_path / "low.json"), "--bits", "3"]
    result = CliRunner().invoke(cli, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text().startswith("# 3 bits from low.json")
    assert parse_kv(str(out)).layer_codecs == parse_kv(result.stdout.strip().splitlines()[-1]).layer_codecs
    notes = tmp_path / "notes.kv"
    notes.write_text("my notes\nsecond line\n")
    refused = CliRunner().invoke(cli, [*args, "--out", str(notes)])
    assert refused.exit_code != 0 and "must hold one spec line" in refused.stderr
    assert notes.read_text() == "my notes\nsecond line\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bits", "3"], "needs at least one --map"),
        (["--map", "missing.json", "--bits", "3"], "cannot read missing.json"),
        (["--map", "{dir}/bad.json", "--bits", "3"], "is not JSON"),
        (["--map", "{dir}/low.json", "--bits", "1"], "below the cheapest choice"),
    ],
)
def test_kv_allocate_errors_are_one_line(tiny_dir, tmp_path, args, message):
    (tmp_path / "low.json").write_text(json.dumps(LOW))
    (tmp_path / "bad.json").write_text("{")
    args = [a.format(dir=tmp_path) for a in args]
    result = CliRunner().invoke(cli, ["kv", "allocate", "--model", str(tiny_dir), *args])
    assert result.exit_code != 0 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(backend.library() is None, reason="the kernels did not build here")
def test_a_mixed_spec_decodes_on_the_kernels_as_on_the_reference(tiny):
    """Each layer's plan reads its own codec: the whole native step on a mixed cache gives the
    logits of the plain PyTorch model, and nothing falls back."""
    ids = torch.randint(3, tiny.config.vocab_size, (2, 80), generator=torch.Generator().manual_seed(3))
    logits = []
    for name in ("kernels-exact", "reference"):
        with backend.using(name):
            before = backend.tally()
            cache = KVCache.for_model(tiny.config, parse_kv(MIXED.replace("residual=0", "residual=8")), 128, batch=2)
            with torch.inference_mode():
                tiny.model(ids[:, :70], cache)
                logits.append(torch.stack([tiny.model(ids[:, t : t + 1], cache)[:, -1] for t in range(70, 80)]))
            ran = backend.tally() - before
            if name == "kernels-exact":
                assert ran["decode step"] == 10  # every decode token: the whole step in one native call
                assert not [k for k in ran if k.startswith("fallback")]  # and no part fell back
    assert torch.allclose(logits[0], logits[1], atol=1e-3, rtol=1e-4)


REPO = Path(__file__).resolve().parent.parent


def test_the_3_bit_map_is_what_kv_allocate_makes_of_the_committed_maps():
    """kv/maps/k3v2mixt.kv is `kv allocate --bits 2.73 --byte-scales` of the four Hamlet maps in
    bench/results: anyone can remake it, and a change to the allocator shows here."""
    maps = [
        (m, json.loads((REPO / "bench" / "results" / f"sensitivity_{m}_hamlet_w1.json").read_text()))
        for m in ("k4v4lmc", "k4v3lmc", "k3v2lm", "k2v2lmc")
    ]
    a = allocate_from_maps(maps, 2.73, 30, 64, byte_scales=True)
    assert a.spec.layer_codecs == parse_kv("k3v2mixt").layer_codecs


# The tiered mixes: body bits an element as allocated, and every byte counted at N 896 (the tier,
# residual, sinks, key center and scales included), as `minillama kv NAME --tokens 896` prints.
TIERED = {"k3v2mixt": (2.73, 2.999), "k2v2mixft": (2.185, 2.499)}


def test_the_tiered_mixes_spend_what_they_say_at_896_tokens():
    """k3v2mixt (3.00 bits) and k2v2mixft (2.50): the body within its allocation's budget, and the
    whole cache -- counted by the rings, equal to kv/budget.py's closed form -- at the preset's bits."""
    for name, (budget, counted) in TIERED.items():
        spec = parse_kv(name)
        assert len(spec.layer_codecs) == 30 and str(spec) == name and spec.tier == 56
        body = sum(k.body_bits(64, 64) + v.body_bits(64, 64) for k, v in spec.layer_codecs) / 60
        assert budget - 0.05 < body <= budget, name
        cache = KVCache(spec, 30, 3, 64, 1024)
        fill_synthetic(cache, 896)
        live = sum(cache.live_bytes().values())
        assert sum(formula_live_bytes(30, 3, 64, spec, 896).values()) == live
        assert round(8 * live / (2 * 30 * 3 * 64 * 896), 3) == counted, name


def test_a_map_is_refused_by_a_model_with_other_layers(tiny_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("one two three four five six seven eight nine ten " * 20, encoding="utf-8")
    args = ["ppl", "--model", str(tiny_dir), "--text", str(text), "--tokens", "64", "--prefill", "16"]
    result = CliRunner().invoke(cli, [*args, "--kv", "k3v2mixt"])
    assert result.exit_code != 0 and "k3v2mixt is a map for a 30-layer model" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
