"""`minillama bench --json`: the schema of its rows (no timing assertions)."""

from __future__ import annotations

import collections
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from minillama.app.cli import cli
from minillama.eval.bench import weight_bytes_per_token
from minillama.kv.cache import KVCache
from minillama.kv.codecs import CODECS
from minillama.kv.freq_blocks import FrequencyBlocks
from minillama.kv.layered import LayeredStore
from minillama.kv.quantize import frequency_block_order
from minillama.kv.spec import codec_named, parse_kv
from minillama.native import backend

KEYS = {
    "kv": str,
    "context": int,
    "decode_ms_per_token": float,
    "decode_tokens_per_s": float,
    "attention_ms_per_layer": float,
    "attention_gb_s": float,
    "projection_ms": float,
    "cache_bytes": int,
    "bytes_read_per_token": int,
    "roofline_pct": float,
    "peak_rss_mb": float,
    "model": str,
    "dtype": str,
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


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_count_what_a_decode_step_reads(tmp_path, tied):
    """The tiny model by hand (hidden 256, 4 heads of 64, 2 KV heads, MLP 256, 2 layers, vocab 300, float32):
    per layer q 256x256, k and v 128x256, o 256x256, gate/up/down 256x256, two norms of 256 = 393,728
    floats; with the final norm 787,712. A step also reads the lm_head (300x256 = 76,800) and one
    embedding row (256); with tied embeddings the table is the lm_head, read once."""
    from minillama.model.loader import load_model
    from tests.conftest import make_tiny

    model = load_model(str(make_tiny(tmp_path / "m", tie_word_embeddings=tied))).model
    floats = 787_712 + 76_800 + (0 if tied else 256)
    assert weight_bytes_per_token(model) == 4 * floats


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


def test_attention_rounds_prints_one_line_per_spec_with_its_ratio():
    """bench/attention_rounds.py (specs timed in turn, medians): a row per spec, the first at 1.00x."""
    script = Path(__file__).parent.parent / "bench" / "attention_rounds.py"
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
    """bench/route_ab.py: per spec, the integer route and the exact one side by side; rows the
    integer kernels do not read (3-bit Lloyd-Max values without VNNI) say so instead of a time."""
    script = Path(__file__).parent.parent / "bench" / "route_ab.py"
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
    """bench/kernel_ab.py: the native sources rebuilt with files from a git revision, both libraries'
    plans timed in turn; against HEAD's own copy of a file a row per spec with its ratio."""
    if backend.library() is None:
        pytest.skip(f"the kernels are not in use: {backend.describe()}")
    repo = Path(__file__).parent.parent
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True).returncode:
        pytest.skip("not a git checkout: kernel_ab.py reads the revision's sources from git")
    script = repo / "bench" / "kernel_ab.py"
    done = subprocess.run(
        [sys.executable, str(script), "HEAD", "40", "hadv2", "2", "smollm2", "layer_attention.cpp"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    rows = done.stdout.strip().splitlines()[1:]
    assert len(rows) == 1 and rows[0].startswith("hadv2") and "tree/HEAD" in rows[0]


def attention_bounds():
    """bench/attention_bounds.py as a module."""
    return load_bench("attention_bounds")


def test_attention_bounds_variants_still_apply_to_the_kernel_source():
    """bench/attention_bounds.py edits native/vnni_attention.cpp (and, for AVX2 builds,
    avx2_attention.cpp and avx2_int_values.cpp) by exact lines: each variant's lines are there
    once, so a change to a kernel cannot leave the script measuring nothing."""
    bounds = attention_bounds()
    native = Path(__file__).parent.parent / "minillama" / "native"
    every = [(name, {bounds.FILE: edits}) for name, edits in bounds.VARIANTS.items()]
    every += list(bounds.AVX2_VARIANTS.items())
    for name, files in every:
        assert files, name
        for file, edits in files.items():
            source = (native / file).read_text()
            assert edits, (name, file)
            for old, _ in edits:
                assert source.count(old) == 1, (name, file, old)
            made = bounds.edited(source, edits, file)
            assert all(new in made for _, new in edits), (name, file)


def test_attention_bounds_times_a_variant_against_the_tree():
    """One variant built and timed beside the tree: a row per spec with the variant's ratio."""
    if backend.library() is None:
        pytest.skip(f"the kernels are not in use: {backend.describe()}")
    script = Path(__file__).parent.parent / "bench" / "attention_bounds.py"
    done = subprocess.run(
        [sys.executable, str(script), "40", "hadv2", "2", "no-values"], capture_output=True, text=True, timeout=600
    )
    if attention_bounds().variant_sources(backend.library()) is None:
        assert done.returncode != 0 and "does not hold" in done.stderr  # it refuses rather than print 1.00s
        pytest.skip("the variants edit the AVX-512 VNNI or AVX2 kernels, which this build does not run")
    assert done.returncode == 0, done.stderr
    rows = done.stdout.strip().splitlines()[2:]
    assert len(rows) == 1 and rows[0].startswith("hadv2") and rows[0].endswith(")")


def test_outlier_gauge_keeps_what_it_says_exact():
    """bench/outlier_gauge.py: no outliers is the codec's own round trip; every entry an outlier
    leaves nothing to quantize (no error); one per row lowers the error of heavy-tailed rows."""
    spec = importlib.util.spec_from_file_location("gauge", Path(__file__).parent.parent / "bench" / "outlier_gauge.py")
    gauge = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gauge)
    codec = CODECS["lm3h"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 40, 64, generator=g)
    x[..., 5] *= 20  # one loud channel, as keys have
    stored = codec.to_space(x)
    plain = codec.decode(codec.encode(stored, 64), 64, 64)
    assert gauge.relative_error(codec, x, 0) == pytest.approx(
        ((plain - stored) ** 2).sum().item() / (stored**2).sum().item()
    )
    assert gauge.relative_error(codec, x, 64) < 1e-10
    assert gauge.relative_error(codec, x, 1) < 0.5 * gauge.relative_error(codec, x, 0)


def test_outlier_ppl_stand_in_decodes_what_it_keeps_and_prices_it():
    """bench/outlier_ppl.py's stand-in codec: with every entry an outlier a row comes back exactly
    (in the rotated space the cache stores); with one, closer than lm3h alone on rows with a loud
    channel; its bits are b + 16/64 + k (8 + 6)/64 by hand."""
    spec = importlib.util.spec_from_file_location("oppl", Path(__file__).parent.parent / "bench" / "outlier_ppl.py")
    oppl = importlib.util.module_from_spec(spec)
    sys.modules["oppl"] = oppl  # its dataclass looks its module up there
    sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))  # it imports outlier_gauge beside it
    try:
        spec.loader.exec_module(oppl)
    finally:
        del sys.modules["oppl"]
        sys.path.pop(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 24, 64, generator=g)
    x[..., 9] *= 25
    stored = CODECS["lm3h"].to_space(x)  # (1, 2, 24, 64): what the cache hands encode
    every = oppl.WithOutliers("t64", 3, "", rotate=True, outliers=64)
    assert torch.allclose(every.decode(every.encode(stored, 64), 64, 64), stored, atol=1e-5)
    one = oppl.WithOutliers("t1", 3, "", rotate=True, outliers=1)
    plain = CODECS["lm3h"].decode(CODECS["lm3h"].encode(stored, 64), 64, 64)
    assert (one.decode(one.encode(stored, 64), 64, 64) - stored).norm() < 0.7 * (plain - stored).norm()
    assert oppl.nominal_bits(3, 1) == 3 + 16 / 64 + 14 / 64 and oppl.nominal_bits(4, 2) == 4 + 16 / 64 + 28 / 64


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


def load_freq_blocks():
    path = Path(__file__).parent.parent / "bench" / "freq_blocks_ppl.py"
    spec = importlib.util.spec_from_file_location("fbppl", path)
    fb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fb)
    return fb


def test_freq_blocks_bits_go_to_the_block_whose_queries_and_keys_carry_the_energy():
    """bench/freq_blocks_ppl.py: per KV head the block widths sum to nb x the budget, the most to
    the block where queries and keys are loud; each layer's table is a codec name the specs take."""
    fb = load_freq_blocks()
    g = torch.Generator().manual_seed(2)
    q = torch.randn(6, 300, 64, generator=g)  # (Hq, T, D): 2 KV heads, R = 3
    k = torch.randn(2, 300, 64, generator=g)  # (Hkv, T, D)
    loud = frequency_block_order(64, 4)[48:64]  # block 3: the lowest frequencies
    q[..., loud] *= 8
    k[..., loud] *= 8
    (table,) = fb.choose_bits([(q, k)], 4, 3)
    for bits in table:  # per KV head
        assert sum(bits) == 12 and bits[3] == max(bits) and bits[3] > 3
    (name,) = fb.block_codecs([(q, k)], 4, 3)
    assert codec_named(name).widths == table


def test_freq_blocks_frontier_spends_an_average_of_k_and_v_bits():
    """bench/freq_blocks_ppl.py --frontier: the per-layer allocation at the budget, block keys in
    every layer with values chosen from the maps' V rows, and block keys offered to the allocation
    beside the maps' own; each row's K and V average at most the budget in stored bits."""
    fb = load_freq_blocks()
    g = torch.Generator().manual_seed(3)
    seen = [(torch.randn(9, 160, 64, generator=g), torch.randn(3, 160, 64, generator=g)) for _ in range(30)]
    seen[7][0][:, :, frequency_block_order(64, 2)[32:]] *= 6  # layer 7's queries on its low frequencies
    assert min(fb.promised(seen, 2, 3)) == fb.promised(seen, 2, 3)[7] < 0.9  # where blocks promise most
    specs = fb.frontier_specs(seen, 30, 3.0)
    assert list(specs)[0] == "fp16" and len(specs) == 5
    for text, (label, bits) in list(specs.items())[1:]:
        kv = parse_kv(text)
        stored = [c.body_bits(64, 64) for pair in kv.layer_codecs for c in pair]
        assert bits == pytest.approx(sum(stored) / 60) and bits <= 3.0 + 1e-9
        assert {v.name for _, v in kv.layer_codecs} <= {"lm2hb", "lm3hb", "lm4hb"}
        blocks = [k for k, _ in kv.layer_codecs if isinstance(k, FrequencyBlocks)]
        if label.startswith("keys 2 blocks"):
            assert len(blocks) == 30 and {k.bits for k in blocks} == {3}  # a 3-bit table a layer
        if label.startswith("joint"):
            assert isinstance(kv.layer_codecs[7][0], FrequencyBlocks)


def test_kernel_lines_charges_an_inlined_helper_to_the_kernel_line_that_called_it():
    """bench/kernel_lines.py: addr2line -i lists an address's frames innermost first; a sample in
    an intrinsic (a compiler header) or a helper of another file counts on the innermost line of
    the kernel's own file (its outermost frame's), so a line's share is what that line costs."""
    spec = importlib.util.spec_from_file_location("lines", Path(__file__).parent.parent / "bench" / "kernel_lines.py")
    lines = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lines)
    frames = [
        "/usr/lib/gcc/avx2intrin.h:114",  # _mm256_maddubs_epi16, inlined
        "/src/native/avx2_int_values.cpp:330 (discriminator 3)",  # the kernel's line
        "/src/native/avx2_int_values.cpp:212",  # the kernel itself
    ]
    assert lines.charge(frames, None) == "/src/native/avx2_int_values.cpp:330"
    helper = ["/src/native/rows.h:40", "/src/native/layer_attention.cpp:99", "/src/native/layer_attention.cpp:20"]
    assert lines.charge(helper, None) == "/src/native/layer_attention.cpp:99"
    assert lines.charge(helper, "/src/native/rows.h") == "/src/native/rows.h:40"
    assert lines.charge(["??:0"], "/src/native/rows.h") is None


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


def test_kernel_instructions_mix_tells_the_kinds_the_core_prices_apart():
    """bench/kernel_instructions.py --mix: an instruction's kind is its mnemonic with its widest
    register and whether it reads memory (a full load or a broadcast) or writes it, from
    objdump's AT&T operands; scalar ones are branches or the rest."""
    kind_of = load_bench("kernel_instructions").kind_of
    assert kind_of("vpdpbusd", "%zmm1,%zmm2,%zmm3") == "vpdpbusd zmm"
    assert kind_of("vpbroadcastd", "0x40(%rsp),%zmm5") == "vpbroadcastd zmm load stack"
    assert kind_of("vmovdqu64", "0x40(%rax),%zmm5") == "vmovdqu64 zmm load"
    assert kind_of("vfmadd132ps", "0x4(%rax){1to16},%zmm2,%zmm1") == "vfmadd132ps zmm 1toN"
    assert kind_of("vmovdqu", "%xmm0,0x10(%rdx)") == "vmovdqu xmm store"
    assert kind_of("vmovups", "%zmm0,(%rax,%rcx,4){%k1}") == "vmovups zmm store"
    assert kind_of("vpermd", "(%r8),%zmm7,%zmm1") == "vpermd zmm load"
    assert kind_of("jne", "1234") == "scalar branch"
    assert kind_of("lea", "(%rsi,%rsi,1),%rax") == "scalar other"


def test_attention_bounds_plus_variants_add_their_instructions_to_every_chunk():
    """bench/attention_bounds.py's plus-* variants: PLUS instructions of the named kind in one
    asm block before the score kernel's heads loop, read-modify-write kinds writing their
    accumulators in turn (one accumulator: a single dependent chain)."""
    bounds = attention_bounds()
    for kind, (form, accumulators) in bounds.INJECTED.items():
        old, new = bounds.injected(kind)
        body = new.replace(old, "").split('asm volatile("')[1].split('"')[0]
        instructions = body.split("\\n\\t")
        assert len(instructions) == bounds.PLUS, kind
        assert all(i.split()[0] == form.split()[0] for i in instructions), kind
        if accumulators:
            written = [i.rsplit(",", 1)[1].strip() for i in instructions]
            assert written == [f"%[a{j % accumulators}]" for j in range(bounds.PLUS)], kind


def test_instruction_rates_prints_a_rate_for_every_kind():
    """bench/instruction_rates.py on a CPU with AVX-512 VNNI: the clock and one row per kind, each
    a positive rate alone; elsewhere it refuses in one line."""
    script = Path(__file__).parent.parent / "bench" / "instruction_rates.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    rates = load_bench("instruction_rates")
    if done.returncode:
        assert "lacks" in done.stderr or "not this machine" in done.stderr, done.stderr
        pytest.skip(done.stderr.strip().splitlines()[-1])
    lines = done.stdout.strip().splitlines()
    ghz = float(lines[0].split()[1])
    assert 0.5 < ghz < 8
    rows = {line[:18].strip(): line[18:].split() for line in lines[2:]}
    assert set(rows) == set(rates.KINDS)
    assert all(float(cells[0]) > 0 for cells in rows.values())


def test_kernel_instructions_pipe_model_charges_each_class_to_its_pipes():
    """bench/kernel_instructions.py's pipe model: two multiply kinds a cycle, four vector adds,
    two loads but one through the stack pointer; a multiply-add with a broadcast memory operand
    also takes half a load port's cycle; register moves and scalar instructions cost the vector
    side nothing."""
    ki = load_bench("kernel_instructions")
    assert ki.pipe_cycles(collections.Counter({"vpdpbusd zmm": 8}))[0] == 4
    assert ki.pipe_cycles(collections.Counter({"vpaddd zmm": 8}))[0] == 2
    assert ki.pipe_cycles(collections.Counter({"vmovdqu64 zmm load": 3}))[0] == 1.5
    assert ki.pipe_cycles(collections.Counter({"vmovdqa64 zmm load stack": 3}))[0] == 3
    bound, per = ki.pipe_cycles(collections.Counter({"vfmadd132ps zmm 1toN": 2, "vmovdqa64 zmm": 5, "scalar other": 9}))
    assert bound == 1 and per["mul"] == 2 and per["broadcast"] == 2 and per["move"] == 5
    assert ki.pipe_class("vpermd zmm load") == "shuffle" and ki.pipe_class("vcvtdq2ps zmm") == "shift/convert"


def test_vector3_stand_in_beats_the_scalar_book_on_gaussian_rows():
    """bench/vector3_ppl.py's stand-in: pairs of rotated coordinates coded by a 64-vector
    Gaussian book at lm3h's bits decode Gaussian rows closer than lm3h's scalar levels do (the
    2-dim book's ~0.89x error), and the decode is what the encode stored."""
    v3 = load_bench("vector3_ppl")
    codec = v3.Vector3("vq3d2", 3, "stand-in", rotate=True, dim=2)
    x = torch.randn(1, 2, 64, 64, generator=torch.Generator().manual_seed(3))
    parts = codec.encode(x, 64)
    decoded = codec.decode(parts, 64, 64)
    scalar = CODECS["lm3h"].decode(CODECS["lm3h"].encode(x, 64), 64, 64)
    vector_error = ((decoded - x) ** 2).mean().item()
    assert torch.equal(decoded, parts["values"])
    assert vector_error < 0.95 * ((scalar - x) ** 2).mean().item()


def test_transform_keys_spends_the_budget_and_decodes_close():
    """bench/transform_keys_ppl.py: a head's bits per coefficient add up to lm3h's budget less
    what its extra scales cost, and the stand-in decodes keys drawn like its calibration keys to
    within a tenth of their energy at 3 bits."""
    tk = load_bench("transform_keys_ppl")
    g = torch.Generator().manual_seed(5)
    k = torch.randn(256, 64, generator=g) * torch.linspace(0.2, 3.0, 64)  # (T, D): uneven channels
    q = torch.randn(768, 64, generator=g)  # (R T, D)
    table = tk.head_table(q, k, "kltk", 3, groups=4, scale_bits=8)
    assert int(table.bits.sum()) == 3 * 64 - (8 * 4 - 16)
    assert sorted(table.group.bincount().tolist()) == [16, 16, 16, 16]
    codec = tk.TransformKeys("tk", 3, "stand-in", heads=[table], scale_bits=8)
    x = k[None, None]  # (1, 1, T, D)
    decoded = codec.decode(codec.encode(x, 64), 64, 64)
    assert ((decoded - x) ** 2).sum() < 0.1 * (x**2).sum()


def test_qjl_sketch_is_unbiased_but_adds_score_error():
    """bench/qjl_keys_ppl.py: the 1-bit sign sketch of lm2's residual takes the shrink out of the
    scores (their slope on the true ones ~1, lm2's ~0.89) but adds to their squared error (the
    sketch's variance pi / (2 D) |q|^2 |r|^2 against |q|^2 |r|^2 / D for the residual left out);
    the unshrunk stand-in is lm2h's decode divided by that slope."""
    qjl = load_bench("qjl_keys_ppl")
    g = torch.Generator().manual_seed(9)
    k, q = torch.randn(4096, 64, generator=g), torch.randn(4096, 64, generator=g)  # (T, D) each
    plain = CODECS["lm2h"].decode(CODECS["lm2h"].encode(k[None, None], 64), 64, 64)[0, 0]
    sketched = qjl.Qjl("qjl2", 2, "stand-in", rotate=True).encode(k[None, None], 64)["values"][0, 0]
    true = (q * k).sum(dim=1)

    def slope_and_error(hat):
        est = (q * hat).sum(dim=1)
        return ((est * true).sum() / (true * true).sum()).item(), ((est - true) ** 2).mean().item()

    (s_plain, e_plain), (s_sketch, e_sketch) = slope_and_error(plain), slope_and_error(sketched)
    assert s_plain < 0.92 and abs(s_sketch - 1) < 0.03
    assert 1.3 * e_plain < e_sketch < 1.8 * e_plain
    unshrunk = qjl.Qjl("lm2u", 2, "stand-in", rotate=True, unshrunk=True).encode(k[None, None], 64)["values"][0, 0]
    assert torch.allclose(unshrunk * qjl.shrink(2), plain, atol=1e-5)


def test_diffused_values_cancel_along_the_tokens_at_a_price_per_row():
    """bench/diffused_values_ppl.py: coding rows in token order with all of each error carried into
    the next row makes the error of a mean over many tokens far smaller than lm2h's, while each
    row's own error about doubles (1 + a^2 for a carry of weight a); the carry persists from one
    call to the next (a decode flush of one token continues the sequence)."""
    dv = load_bench("diffused_values_ppl")
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1)).to(torch.float16)  # (N, H, T, D)
    plain = CODECS["lm2h"].decode(CODECS["lm2h"].encode(x, 64), 64, 64) - x.float()
    codec = dv.Diffused("lm2d100", 2, "stand-in", rotate=True, weight=1.0)
    diffused = codec.encode(x[:, :, :63], 64)["values"] - x[:, :, :63].float()
    assert 1.6 < (diffused**2).mean() / (plain[:, :, :63] ** 2).mean() < 2.4
    assert (diffused.mean(dim=2) ** 2).mean() < 0.1 * (plain[:, :, :63].mean(dim=2) ** 2).mean()
    carry = codec.carries[(2, 3, 64)].clone()
    last = codec.encode(x[:, :, 63:], 64)["values"]  # one token: the carry goes on
    expected = dv.diffuse(x[:, :, 63:], carry, 2, 64, 1.0)
    assert torch.equal(last, expected)


def tier_setup(monkeypatch):
    """bench/tier_ppl.py with EXACT 3, a 2-layer 2-bit spec with a 16-row residual and 2 sinks,
    and its appends: a prompt of 20 tokens, then ten decode tokens ((K, V) per layer each); every
    write through LayeredStore.append, where the script hooks in."""
    tp = load_bench("tier_ppl")
    monkeypatch.setattr(tp, "EXACT", 3)
    spec = parse_kv("k=lm2hb,v=lm2hb,group=64,residual=16,sinks=2")
    g = torch.Generator().manual_seed(0)
    kv = [
        [(torch.randn(1, 2, n, 64, generator=g), torch.randn(1, 2, n, 64, generator=g)) for _ in range(2)]
        for n in [20] + [1] * 10
    ]
    monkeypatch.setattr(LayeredStore, "token_write", lambda self, x: None)
    return tp, spec, kv


def test_tier_codes_every_residual_row_but_the_newest_once(monkeypatch):
    """bench/tier_ppl.py: after a prompt and decode tokens the residual holds its newest EXACT rows
    as an unchanged cache holds them, and every older one as the tier codec codes and decodes
    the exact row (once, whatever appends it lived through); the sinks stay exact."""
    tp, spec, kv = tier_setup(monkeypatch)
    plain = KVCache(spec, 2, 2, 64, 128)
    for step in kv:
        plain.append(step)
    monkeypatch.setattr(LayeredStore, "append", tp.append_through_tier)
    tiered = KVCache(spec, 2, 2, 64, 128)
    for step in kv:
        tiered.append(step)
    for a, b in zip(plain.stores, tiered.stores):
        held = a.residual.lead.count
        assert held == b.residual.lead.count == 16
        exact, coded = a.residual.read(0, held), b.residual.read(0, held)  # (L, B, H, n, D)
        assert torch.equal(coded[:, :, :, -3:], exact[:, :, :, -3:])
        assert torch.equal(coded[:, :, :, :-3], tp.tiered(a, exact[:, :, :, :-3]))
        assert not torch.equal(coded[:, :, :, :-3], exact[:, :, :, :-3])
        assert torch.equal(b.sinks.read(0, 2), a.sinks.read(0, 2))


def test_decode_signal_reads_the_cache_as_a_decode_step_holds_it():
    """bench/decode_signal.py's attention of each decode query over a cache whose body is coded:
    the plain causal attention where the body equals the exact rows; with another body, a query
    whose history is all sinks and residual is untouched, and a later one reads exactly the
    sinks, the coded body and the newest `residual` rows (and itself), as written out by hand."""
    signal, proxies = load_bench("decode_signal"), load_bench("sensitivity_proxies")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 20, 8, generator=g) for h in (6, 2, 2))  # GQA 3
    plain = proxies.attention(q, k, v)  # (1, 6, 20, 8): every position reads 0..itself
    first, sinks, residual = 5, 2, 3
    assert torch.allclose(
        signal.cached_attention(q, k, v, k, v, first, sinks, residual), plain[:, :, first:], atol=1e-6
    )

    kq, vq = k + torch.randn(k.shape, generator=g), v + torch.randn(v.shape, generator=g)
    held = signal.cached_attention(q, k, v, kq, vq, first, sinks, residual)  # (1, 6, 15, 8)
    assert torch.allclose(held[:, :, 0], plain[:, :, first], atol=1e-6)  # position 5: sinks 0-1, residual 2-4
    t = 19  # sinks 0-1 exact, the body 2-15 coded, 16-18 and 19 itself exact
    keys = torch.cat([k[:, :, :sinks], kq[:, :, sinks : t - residual], k[:, :, t - residual :]], dim=2)
    values = torch.cat([v[:, :, :sinks], vq[:, :, sinks : t - residual], v[:, :, t - residual :]], dim=2)
    by_hand = proxies.attention(q, keys, values)[:, :, t]
    assert torch.allclose(held[:, :, t - first], by_hand, atol=1e-5)
    assert not torch.allclose(held[:, :, t - first], plain[:, :, t], atol=1e-3)


def test_tier_from_exact_codes_the_body_from_exact_rows(monkeypatch):
    """bench/tier_ppl.py --from-exact: the residual reads as with the double-rounding tier (the
    newest EXACT rows exact, the older ones as the tier codes them), but the rows that left it
    for the body were coded from their exact values: the body equals an unchanged cache's."""
    tp, spec, kv = tier_setup(monkeypatch)
    appends = {"plain": tp._append, "double": tp.append_through_tier, "exact": tp.append_coding_the_body_from_exact}
    caches = {name: KVCache(spec, 2, 2, 64, 128) for name in appends}
    for name, cache in caches.items():
        monkeypatch.setattr(LayeredStore, "append", appends[name])
        for step in kv:
            cache.append(step)
    for a, b, c in zip(caches["plain"].stores, caches["double"].stores, caches["exact"].stores):
        held = a.residual.lead.count
        assert torch.equal(c.residual.read(0, held), b.residual.read(0, held))
        body = {name: ring.lead.count for name, ring in a.body.items()}  # codes and scales: 30 - 2 sinks - 16
        assert all(n == 12 for n in body.values())
        assert all(torch.equal(c.body[k].read(0, n), a.body[k].read(0, n)) for k, n in body.items())
        assert not all(torch.equal(b.body[k].read(0, n), a.body[k].read(0, n)) for k, n in body.items())


def test_own_windows_pool_as_a_batch_of_windows_would(tiny):
    """bench/own_window_ppl.py: each window in its own cache, pooled; for specs that choose
    nothing per sequence that is ``evaluate`` over the same windows as one batch."""
    from minillama.eval.perplexity import evaluate

    own = load_bench("own_window_ppl")
    ids = tiny.tokenizer.encode("It was the best of times, it was the worst of times. " * 12)
    specs = [parse_kv("fp32"), parse_kv("kivi4")]
    rows = own.own_windows(tiny, ids, specs, n=96, prefill=16, windows=2)
    batch = evaluate(tiny, ids, specs, n=96, prefill=16, windows=2, blind=False)
    for row, whole in zip(rows, batch):
        assert row["ppl"] == pytest.approx(whole.ppl, rel=1e-4)
        assert row["kld_mean"] == pytest.approx(whole.kld_mean, rel=1e-3, abs=1e-7)
    assert rows[0]["delta_pct"] == 0 and len(rows[1]["windows_ppl"]) == 2


def test_rms_scales_leave_each_codebook_scale_at_its_groups_rms_and_put_refinement_back():
    """bench/rms_scale.py: inside, a Lloyd-Max group's scale is its RMS (as fp16); after, refined."""
    from minillama.kv.quantize import quantize_codebook

    rms = load_bench("rms_scale")
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0))  # (H, T, D)
    with rms.rms_scales():
        _, scale = quantize_codebook(x, 3, 64)
    assert torch.equal(scale.float(), x.pow(2).mean(-1, keepdim=True).sqrt().half().float())
    _, refined = quantize_codebook(x, 3, 64)
    assert not torch.equal(refined, scale)
