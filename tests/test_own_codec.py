"""Adding a codec is one class: the worked example of docs/cache.md, end to end.

The codec below is defined here, in the test, not in the package: symmetric ("absmax") codes,
round(x / s) with s = max|x| / (2^(b-1) - 1) per group of G channels of a token, stored with
an offset of 2^(b-1) so they pack as unsigned codes, and one fp16 scale per group:
b + 16/G bits per element. Registered, it is usable in --kv specs, the cache stores and
counts it, ``ppl`` evaluates it, and since it declares no kernel row kind, decode attention
reads it through the reference path and says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from click.testing import CliRunner

from minillama.app.cli import cli
from minillama.eval.synthetic import fill_synthetic
from minillama.kv import packing
from minillama.kv.cache import KVCache
from minillama.kv.codecs import CODECS, Codec, PartSpec, register
from minillama.kv.spec import parse_kv
from minillama.native import backend


@dataclass(frozen=True)
class AbsMax(Codec):
    """Symmetric per-token codes with one fp16 absmax scale per G channels."""

    channel_groups: ClassVar[bool] = True  # G must divide head_dim (Codec.validate checks it)

    def bits_formula(self) -> str:
        return f"{self.bits} + 16/G  (fp16 absmax scale per G channels)"

    def parts(self, head_dim: int, group: int) -> list[PartSpec]:
        return [self.codes_part(head_dim), PartSpec("scale", torch.float16, head_dim // group, 1)]

    def encode(self, x, group, params=None):
        top = 2 ** (self.bits - 1) - 1
        xg = x.float().unflatten(-1, (-1, group))  # (B, H, T, D/G, G)
        scale = (xg.abs().amax(-1) / top).to(torch.float16)  # (B, H, T, D/G)
        s = scale.float().clamp_min(1e-12).unsqueeze(-1)
        codes = (xg / s).round().clamp(-top, top) + top + 1  # (B, H, T, D/G, G) in 1 .. 2^b - 1
        return {"codes": packing.pack(codes.flatten(-2).to(torch.uint8), self.bits), "scale": scale}

    def decode(self, parts, group, head_dim, params=None):
        codes = self.unpack(parts, head_dim).float() - 2 ** (self.bits - 1)  # (B, H, T, D)
        return (codes.unflatten(-1, (-1, group)) * parts["scale"].float().unsqueeze(-1)).flatten(-2)


@pytest.fixture
def absmax4():
    """absmax4 registered for this test only (the registry is the process's)."""
    codec = register(AbsMax("absmax4", 4, "symmetric int4, fp16 absmax scale per G channels"))
    try:
        yield codec
    finally:
        del CODECS[codec.name]


def test_a_registered_codec_parses_and_round_trips(absmax4):
    spec = parse_kv("k=absmax4,v=absmax4,group=32,residual=4")
    assert spec.k is absmax4 and spec.v is absmax4
    x = torch.randn(1, 2, 10, 64)
    parts = absmax4.encode(x, 32)
    y = absmax4.decode(parts, 32, 64)
    step = x.abs().unflatten(-1, (2, 32)).amax(-1) / 7  # (B, H, T, 2): each group's code step
    assert ((x - y).abs().unflatten(-1, (2, 32)) <= step.unsqueeze(-1) / 2 * 1.01 + 1e-3).all()


def test_the_cache_stores_and_counts_it(absmax4):
    cache = KVCache(
        parse_kv("k=absmax4,v=absmax4,group=32,residual=4"), n_layers=2, n_kv_heads=2, head_dim=64, capacity=128
    )
    fill_synthetic(cache, 100)
    live = cache.live_bytes()  # 96 tokens quantized per tensor: 32 code bytes + 2 fp16 scales each
    assert live["codes"] == 2 * 2 * 2 * 96 * 32 and live["scales"] == 2 * 2 * 2 * 96 * 4
    assert live["residual"] == 2 * 2 * 2 * 4 * 128


def test_ppl_evaluates_it_through_the_reference_attention(absmax4, tiny_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 30)
    seen = len(backend.fallbacks())
    result = CliRunner().invoke(
        cli,
        [
            "ppl",
            "--model",
            str(tiny_dir),
            "--text",
            str(text),
            "--tokens",
            "96",
            "--prefill",
            "16",
            "--kv",
            "fp32",
            "--kv",
            "k=absmax4,v=absmax4,group=32,residual=4",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    exact, ours = json.loads(result.stdout)
    assert ours["kv"] == "k=absmax4,v=absmax4,group=32,residual=4"
    assert ours["ppl"] != exact["ppl"] and abs(ours["ppl"] / exact["ppl"] - 1) < 0.05
    assert 4.5 < ours["bits_per_element"] < 16  # 4 + 16/32 bits in the body, fp16 in the residual
    if backend.library() is not None:  # the kernels decline it, with the reason, and the reference runs
        assert any("absmax4 declares no kernel row kind" in r for r in backend.fallbacks()[seen:])
