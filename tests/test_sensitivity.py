"""The sensitivity map (eval/sensitivity.py): one tensor of one layer quantized, the rest float32.

Each variant is a real cache whose layers hold different codecs (KVSpec.layer_codecs), all
decoded as one batch; these tests check the variants' layouts, that a variant's numbers are the
numbers of that cache run alone, and the CLI's output."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from minillama.app.cli import cli
from minillama.eval.perplexity import evaluate
from minillama.eval.sensitivity import EXACT, sensitivity, variants
from minillama.kv.cache import KVCache
from minillama.kv.spec import parse_kv

TEXT = "In the beginning the lamps were lit one by one, and the street grew quiet under the rain. " * 8


@pytest.fixture(scope="module")
def ids(tiny):
    return tiny.tokenizer.encode(TEXT)


def test_each_variant_quantizes_exactly_one_tensor_of_one_layer():
    spec = parse_kv("hadv2")
    rows = variants(spec, 3)
    assert [(v.layer, v.tensor) for v in rows] == [
        (0, "k"), (0, "v"), (1, "k"), (1, "v"), (2, "k"), (2, "v"), (None, "k"), (None, "v"), (None, "all"),
    ]  # fmt: skip
    for v in rows[:6]:
        quantized = [(i, t) for i in range(3) for t, (codec, _, _) in zip("kv", v.spec.tensors(i)) if codec != EXACT]
        assert quantized == [(v.layer, v.tensor)]
    assert all(
        v.spec.tensors(i)[0][0] == spec.k and v.spec.tensors(i)[1][0] == EXACT for v in rows[6:7] for i in range(3)
    )
    assert rows[-1].spec == spec


def test_a_variant_cache_stores_its_layers_in_their_own_codecs(tiny):
    """Layer 1's values quantized, everything else float32: the bytes say so."""
    spec = variants(parse_kv("kivi4"), tiny.config.num_hidden_layers)[3].spec  # layer 1, V
    cache = KVCache.for_model(tiny.config, spec, 128)
    assert [(k.codec.name, v.codec.name) for k, v in cache.layers] == [("fp32", "fp32"), ("fp32", "int4")]


def test_the_map_rows_are_the_variants_run_alone(tiny, ids):
    rows = sensitivity(tiny, ids, parse_kv("kivi2"), n=96, prefill=16)
    assert len(rows) == 2 * tiny.config.num_hidden_layers + 3
    assert set(rows[0]) >= {"kv", "layer", "tensor", "kld_mean", "ppl"}
    assert all(r["kv"] == "kivi2" for r in rows)
    whole = next(r for r in rows if r["tensor"] == "all")
    (alone,) = evaluate(tiny, ids, [parse_kv("kivi2")], n=96, prefill=16, blind=False)
    assert whole["ppl"] == pytest.approx(alone.ppl, rel=1e-4)
    assert whole["kld_mean"] == pytest.approx(alone.kld_mean, rel=1e-2)
    one = next(r for r in rows if r["layer"] == 0 and r["tensor"] == "k")
    (layer0,) = evaluate(tiny, ids, [variants(parse_kv("kivi2"), 2)[0].spec], n=96, prefill=16, blind=False)
    assert one["kld_mean"] == pytest.approx(layer0.kld_mean, rel=1e-2)
    assert 0 < one["kld_mean"] < whole["kld_mean"]  # one tensor of four costs less than all of them


def test_an_exact_scheme_loses_nothing_anywhere(tiny, ids):
    rows = sensitivity(tiny, ids, parse_kv("fp32"), n=64, prefill=16)
    assert max(r["kld_mean"] for r in rows) < 1e-6


def test_the_cli_prints_json_rows_and_draws_the_heatmap(tiny_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    png = tmp_path / "map.png"
    args = ["ppl", "--model", str(tiny_dir), "--text", str(text), "--tokens", "64", "--prefill", "16"]
    result = CliRunner().invoke(cli, [*args, "--sensitivity", "--kv", "hadv2", "--json", "--plot", str(png)])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert {(r["layer"], r["tensor"]) for r in rows} >= {(0, "k"), (1, "v"), (None, "k"), (None, "v"), (None, "all")}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = CliRunner().invoke(cli, [*args, "--sensitivity", "--kv", "hadv2"])
    assert table.exit_code == 0 and "V of every layer" in table.stdout


@pytest.mark.parametrize("extra", [["--kv", "hadv2", "--kv", "kivi4"], ["--kv", "hadv2", "--ctx", "32"], []])
def test_the_map_takes_one_scheme_and_says_so(tiny_dir, tmp_path, extra):
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    result = CliRunner().invoke(cli, ["ppl", "--model", str(tiny_dir), "--text", str(text), "--sensitivity", *extra])
    assert result.exit_code != 0 and "--sensitivity maps one scheme" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
