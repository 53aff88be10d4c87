"""`minillama bench --json`: the schema of its rows (no timing assertions)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from minillama.eval.bench import weight_bytes_per_token
from minillama.app.cli import cli

KEYS = {"kv": str, "context": int, "decode_ms_per_token": float, "decode_tokens_per_s": float, "cache_bytes": int,
        "bytes_read_per_token": int, "roofline_pct": float, "peak_rss_mb": float, "model": str, "dtype": str, "fill": str,
        "fused": bool}


def test_bench_json_schema(tiny_dir):
    result = CliRunner().invoke(cli, ["bench", "--model", str(tiny_dir), "--kv", "fp16", "--kv", "hadv2", "--context", "40",
                                      "--context", "100", "--decode-tokens", "2", "--fill", "synthetic", "--dtype", "float32",
                                      "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["bandwidth_bytes_per_s"] > 0
    assert [(r["kv"], r["context"]) for r in out["rows"]] == [("fp16", 40), ("hadv2", 40), ("fp16", 100), ("hadv2", 100)]
    for row in out["rows"]:
        assert all(isinstance(row[k], t) for k, t in KEYS.items()), row
        assert row["prefill_tokens_per_s"] is None  # synthetic fill: nothing was prefilled
        assert row["bytes_read_per_token"] > row["cache_bytes"]  # weights + the whole cache


def test_weight_bytes_count_a_tied_table_once(tiny):
    model = tiny.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.model.embed_tokens.weight
    # untied tiny model: the embedding table is not read, only one row of it
    assert weight_bytes_per_token(model) == total - emb.numel() * 4 + emb.shape[1] * 4
