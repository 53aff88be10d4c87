"""`minillama bench --json`: the schema of its rows (no timing assertions)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from minillama.app.cli import cli
from minillama.eval.bench import weight_bytes_per_token
from minillama.native import backend

KEYS = {
    "kv": str,
    "context": int,
    "decode_ms_per_token": float,
    "decode_tokens_per_s": float,
    "spread_pct": float,
    "attention_ms_per_layer": float,
    "attention_gb_s": float,
    "projection_ms": float,
    "cache_bytes": int,
    "bytes_read_per_token": int,
    "roofline_pct": float,
    "peak_rss_mb": float,
    "model": str,
    "dtype": str,
    "weights": str,
    "fill": str,
    "backend": str,
    "fallbacks": list,
}


def test_bench_json_schema(tiny_dir):
    result = CliRunner().invoke(
        cli,
        [
            "bench",
            "--model",
            str(tiny_dir),
            "--kv",
            "fp16",
            "--kv",
            "hadv2",
            "--context",
            "40",
            "--context",
            "100",
            "--decode-tokens",
            "2",
            "--fill",
            "synthetic",
            "--dtype",
            "float32",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["bandwidth_bytes_per_s"] > 0
    assert [(r["kv"], r["context"]) for r in out["rows"]] == [
        ("fp16", 40),
        ("hadv2", 40),
        ("fp16", 100),
        ("hadv2", 100),
    ]
    for row in out["rows"]:
        assert all(isinstance(row[k], t) for k, t in KEYS.items()), row
        assert row["prefill_tokens_per_s"] is None  # synthetic fill: nothing was prefilled
        assert row["bytes_read_per_token"] > row["cache_bytes"]  # weights + the whole cache
        # timed apart from the steps, so on a loaded machine either may exceed a step's time
        # (a 72 ms stall once did): the schema holds their sign, not their order
        assert row["attention_ms_per_layer"] > 0 and row["projection_ms"] > 0 and row["decode_ms_per_token"] > 0
        # GB/s is the bytes one layer's attention read over its time
        layer_bytes = row["attention_gb_s"] * 1e6 * row["attention_ms_per_layer"]
        assert layer_bytes == pytest.approx(row["cache_bytes"] / 2, rel=0.1)  # one of the 2 layers' share of the cache


def bench_row(**changes):
    from minillama.eval.bench import BenchRow

    row = dict.fromkeys(KEYS, 1.0) | {"kv": "fp16", "context": 512, "fallbacks": [], "backend": "kernels"}
    return BenchRow(**{**row, "prefill_tokens_per_s": None, **changes})


def test_the_table_warns_when_the_steps_of_a_row_disagree_and_explains_its_columns():
    """A step time spread of 90% (a busy machine: 'attn GB/s 0.0', 'proj ms 972') earns one
    warning line; 5% does not. Every column heading is explained under the table."""
    from minillama.eval.bench import COLUMNS, format_table

    calm = format_table([bench_row(spread_pct=5.0)], 1e10)
    busy = format_table([bench_row(spread_pct=5.0), bench_row(spread_pct=90.0)], 1e10)
    assert "warning" not in calm and "warning: the decode steps of 1 row(s) varied by up to 90%" in busy
    header = calm.splitlines()[1]
    for name in ("ms/tok", "spread", "attn ms/layer", "attn GB/s", "prefill/s", "cache MB", "read MB/tok"):
        assert name in header and f"  {name}" in COLUMNS
    for name in ("roofline", "peak RSS", "proj ms"):
        assert name in header and f"  {name}" in COLUMNS


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_count_what_a_decode_step_reads(tmp_path, tied):
    """The tiny model by hand (hidden 256, 4 heads of 64, 2 KV heads, MLP 256, 2 layers, vocab 300, float32):
    per layer q 256x256, k and v 128x256, o 256x256, gate/up/down 256x256, two norms of 256 = 393,728
    floats; with the final norm 787,712. A step also reads the lm_head (300x256 = 76,800) and one
    embedding row (256); with tied embeddings the table is the lm_head, read once."""
    from minillama.native.fast import load_model
    from tests.conftest import make_tiny

    model = load_model(str(make_tiny(tmp_path / "m", tie_word_embeddings=tied))).model
    floats = 787_712 + 76_800 + (0 if tied else 256)
    assert weight_bytes_per_token(model) == 4 * floats


def test_the_bandwidth_probe_reads_on_the_kernels_threads_and_gives_the_count_back(monkeypatch):
    # A decode step's thread chooser may leave OpenMP (shared with PyTorch) on one core: the probe
    # must still stream on the threads the kernels run on, then leave the count as it found it.
    import torch

    from minillama.eval.bench import measure_bandwidth

    counts = []
    monkeypatch.setattr(backend, "threads", lambda: 2)
    monkeypatch.setattr(torch.Tensor, "sum", lambda self: counts.append(torch.get_num_threads()) or self[0])
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert measure_bandwidth(mb=8, repeats=3) > 0
        assert counts == [2] * 4  # a warm-up read, then 3 timed ones
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_bench_prefill_reads_a_text_file(tiny_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("A short text to prefill. " * 20)
    result = CliRunner().invoke(
        cli,
        [
            "bench",
            "--model",
            str(tiny_dir),
            "--kv",
            "k=fp16,v=fp16,rope=pre",
            "--context",
            "64",
            "--decode-tokens",
            "2",
            "--text",
            str(text),
            "--dtype",
            "float32",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)["rows"]
    assert row["fill"] == "prefill" and row["prefill_tokens_per_s"] > 0


def test_bench_with_too_short_a_text_is_one_line(tiny_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("tiny")
    result = CliRunner().invoke(cli, ["bench", "--model", str(tiny_dir), "--context", "64", "--text", str(text)])
    assert result.exit_code == 1 and "fewer than --context 64" in result.stderr and "--fill synthetic" in result.stderr


def test_bench_plot_is_written(tiny_dir, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "decode.png"
    result = CliRunner().invoke(
        cli,
        [
            "bench",
            "--model",
            str(tiny_dir),
            "--kv",
            "fp16",
            "--context",
            "40",
            "--context",
            "80",
            "--decode-tokens",
            "2",
            "--fill",
            "synthetic",
            "--dtype",
            "float32",
            "--plot",
            str(png),
        ],
    )
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_step_rounds_prints_each_schemes_step_and_its_ratio_to_the_first(tiny_dir):
    """bench/step_rounds.py: whole decode steps of each scheme in turn, a row per scheme with its
    median ms and the median ratio to the first scheme (1.000 for the first itself)."""
    if backend.library() is None:
        pytest.skip(f"the kernels are not in use: {backend.describe()}")
    script = Path(__file__).parent.parent / "bench" / "step_rounds.py"
    done = subprocess.run(
        [sys.executable, str(script), "40", "fp16;hadv2", "1", str(tiny_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    rows = done.stdout.strip().splitlines()[2:]
    assert [r.split()[0] for r in rows] == ["fp16", "hadv2"] and rows[0].split()[2] == "1.000"


def test_attention_rounds_prints_one_line_per_spec_with_its_ratio():
    """tools/attention_rounds.py (specs timed in turn, medians): a row per spec, the first at 1.00x."""
    script = Path(__file__).parent.parent / "tools" / "attention_rounds.py"
    done = subprocess.run(
        [sys.executable, str(script), "40", "fp16;k=int4c,v=int2h,group=32,residual=8", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    rows = done.stdout.strip().splitlines()[1:]
    assert len(rows) == 2 and rows[0].startswith("fp16") and rows[0].endswith("1.00x")
    assert rows[1].startswith("k=int4c,v=int2h") and rows[1].endswith("x")


def test_route_ab_times_both_routes_or_says_why_one_refused():
    """tools/route_ab.py: per spec, the integer route and the exact one side by side; rows the
    integer kernels do not read (3-bit Lloyd-Max values without VNNI) say so instead of a time."""
    script = Path(__file__).parent.parent / "tools" / "route_ab.py"
    specs = "k=int4c,v=int2h,group=32,residual=8;k=int4c,v=lm3h,group=64,residual=8"
    done = subprocess.run(
        [sys.executable, str(script), "values", "64", specs, "2"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    rows = done.stdout.strip().splitlines()[1:]
    assert len(rows) == 2 and all(" token " in row for row in rows)
    assert rows[0].startswith("k=int4c,v=int2h") and "integer" in rows[0] and rows[0].endswith(" ns")
    assert "integer refused" in rows[1] or rows[1].count(" ns") == 2


def test_kernel_ab_times_the_tree_against_a_revision_in_turn():
    """tools/kernel_ab.py: the native sources rebuilt with files from a git revision, both libraries'
    plans timed in turn; against HEAD's own copy of a file a row per spec with its ratio."""
    if backend.library() is None:
        pytest.skip(f"the kernels are not in use: {backend.describe()}")
    repo = Path(__file__).parent.parent
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True).returncode:
        pytest.skip("not a git checkout: kernel_ab.py reads the revision's sources from git")
    script = repo / "tools" / "kernel_ab.py"
    done = subprocess.run(
        [sys.executable, str(script), "HEAD", "40", "hadv2", "2", "smollm2", "layer_attention.cpp"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    rows = done.stdout.strip().splitlines()[1:]
    assert len(rows) == 1 and rows[0].startswith("hadv2") and "tree/HEAD" in rows[0]


def test_step_ab_runs_each_build_in_turn_on_a_model_of_ones_choice(tiny_dir):
    """tools/step_ab.py: whole decode steps of the tree's build and a revision's, in turn. Each
    build's own step must run (the model asks ``backend.library()`` for its kernels): both lines
    show projection time, and the ratio line follows."""
    if backend.library() is None:
        pytest.skip(f"the kernels are not in use: {backend.describe()}")
    repo = Path(__file__).parent.parent
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True).returncode:
        pytest.skip("not a git checkout: step_ab.py reads the revision's sources from git")
    done = subprocess.run(
        [
            sys.executable,
            str(repo / "tools" / "step_ab.py"),
            "HEAD",
            "abi.cpp",
            "40",
            "2",
            "fp16",
            "native",
            str(tiny_dir),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    builds = [line for line in lines if line.startswith(("tree ", "HEAD "))]
    assert len(builds) == 2 and all(float(b.split("projections ")[1].split()[0]) > 0 for b in builds), lines
    assert lines[-1].startswith("tree/HEAD: step ")


def test_peers_interleave_times_the_engines_in_turn_and_reports_the_ratio_spread():
    """bench/peers.py --rounds: a, b, a, b, ... and per round a / b (median, min, max), so a target
    ratio is judged on rounds taken side by side, not on two runs minutes apart."""
    spec = importlib.util.spec_from_file_location("peers", Path(__file__).parent.parent / "bench" / "peers.py")
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    calls, a, b = [], iter([10.0, 30.0, 20.0]), iter([10.0, 10.0, 10.0])
    row = peers.interleave({"a": lambda: calls.append("a") or next(a), "b": lambda: calls.append("b") or next(b)}, 3)
    assert calls == ["a", "b"] * 3
    assert row["a_tokens_per_s"] == 20.0 and row["b_tokens_per_s"] == 10.0
    assert (row["ratio_median"], row["ratio_min"], row["ratio_max"], row["rounds"]) == (2.0, 1.0, 3.0, 3)
    assert "ceiling_ratio_median" not in row  # no floor asked


def test_peers_interleave_says_what_the_memory_allowed_each_round():
    """With a floor (the tokens/s a round's probed bandwidth allows for a token's bytes) each round
    also gives the first engine's share of it and the ceiling ratio, floor / second engine: the
    most any engine reading those bytes could have shown that round."""
    spec = importlib.util.spec_from_file_location("peers", Path(__file__).parent.parent / "bench" / "peers.py")
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    calls, a, b, f = [], iter([10.0, 30.0, 18.0]), iter([10.0, 10.0, 12.0]), iter([20.0, 40.0, 24.0])
    runs = {"a": lambda: calls.append("a") or next(a), "b": lambda: calls.append("b") or next(b)}
    row = peers.interleave(runs, 3, floor=lambda: calls.append("probe") or next(f))
    assert calls == ["a", "b", "probe"] * 3  # each round's probe right after its two engines
    assert row["floor_tokens_per_s"] == 24.0
    assert (row["ceiling_ratio_median"], row["ceiling_ratio_min"], row["ceiling_ratio_max"]) == (2.0, 2.0, 4.0)
    assert row["roofline_pct_median"] == 75.0  # 10/20, 30/40, 18/24


def load_bench(name: str):
    """A bench/ script as a module (its neighbours in bench/ importable while it loads, and
    itself in sys.modules, where a dataclass looks its module up)."""
    spec = importlib.util.spec_from_file_location(
        f"bench_{name}", Path(__file__).parent.parent / "bench" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
        del sys.modules[spec.name]
    return module
