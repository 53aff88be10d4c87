"""Where one layer's integer attention spends its time, by taking parts of the work away.

    python bench/attention_bounds.py 8192 "fp16;hadv2;kivi4;k4v3hc;k3v2lm" 10
    python bench/attention_bounds.py 8192 "hadv2" 10 no-scores,no-values      # only these variants
    python bench/attention_bounds.py 8192 "fp16;hadv2" 7 no-scores,no-values tinyllama   # another layer shape

Each variant is the tree's ``native/vnni_attention.cpp`` (on a build with AVX-512 VNNI) or its
AVX2 twins ``avx2_attention.cpp`` and ``avx2_int_values.cpp`` (on an AVX2 build: the first three
variants only) with one piece of the kernels' work removed or made free, built as its own
library; every spec's 30-layer cache
(``bench/attention_rounds.py: Layers``) is timed through the tree's build and every variant in
turn (each round starting one build later), round after round, and each variant's median per-round ratio to the tree is printed. **A
variant computes wrong attention**: it exists to measure what a piece of the work costs, or
the most a change could buy, never to be used. The variants:

* ``no-scores`` / ``no-values`` / ``neither``: the score kernels write zeros / the value
  kernels add nothing / both; what is left is the driver (softmax, merge, sinks and residual
  parts, thread start and join) and the kernels' absence measures their share of the layer. On
  AVX2 both the integer kernels (``score_int4``, ``score_int2``, ``value_bytes``) and the float
  ones that read the other codecs (``score_fast``, ``value_fast``) are emptied.
* ``keys-in-l1`` / ``values-in-l1``: every block of key (value) rows is read from the head's
  first slots, which stay in L1, instead of its own: the share of the time spent waiting for
  rows to arrive from memory.
* ``no-transpose``: the score kernel loads 16 rows' chunks straight into registers instead of
  transposing them (same bytes, wrong lanes): the most a key layout stored chunk-major, in the
  order the kernel reads it, could buy.
* ``one-step``: ``no-transpose`` and one int8 query step per head instead of one per 8 channels
  (the per-chunk conversions and multiply-adds gone): the most a coarser query contract could
  add to it.
* ``one-fold``: KIVI keys fold the per-channel scales of the first group they meet into the
  int8 query and keep that query for every later group (the per-group re-quantization gone):
  the most a cheaper fold could buy.
* ``no-prefetch`` / ``far-prefetch``: the score kernel's software prefetch of the key rows
  two 16-row chunks ahead left out, or made 32 chunks ahead: what prefetching buys.
* ``plus-valu``, ``plus-shuffle``, ``plus-permute``, ``plus-dpbusd``, ``plus-fma``,
  ``plus-load``, ``plus-scalar``, ``plus-nop``: the score kernel does PLUS (128) more
  independent instructions of one kind per 16-token chunk -- 8 per KV token -- whose results
  nobody reads (``INJECTED``): what one more instruction of that kind costs inside the real
  kernel. A machine without cycle counters cannot say which of its units binds; the price of
  an added instruction can: a kind that costs nothing is not on the binding path, a kind that
  costs what the kernel's average instruction costs is. ``plus-chain`` makes its 128 adds one
  dependent chain (128 cycles of latency a chunk, 32 of issue): if the core overlapped a chunk's
  chains with the next chunk's work it would cost about as much as ``plus-valu``; if a chunk's
  latency shows, up to 128 cycles a chunk.

On a VNNI build fp16 rows do not go through these kernels: an fp16 spec reads ~1.00 on every
variant and gives the scale (the ratio a quantized spec must reach, 0.40x fp16's layer in issue
26). On AVX2 fp16 rows take the float kernels ``score_fast`` and ``value_fast``, so the three
variants take fp16's layer apart too; its tree column is still the scale. A fifth argument
names another layer shape (``bench/attention_rounds.py``: ``tinyllama``, GQA 8; ``llama3``,
head_dim 128); an empty fourth then means every variant.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import tempfile
from pathlib import Path

from attention_rounds import Layers, spec_list  # bench/ is the script's folder, so on sys.path
from kernel_ab import library_with

from minillama.native import abi, backend, build

FILE = "vnni_attention.cpp"
AVX2_SCORES, AVX2_VALUES = "avx2_attention.cpp", "avx2_int_values.cpp"

ZERO_SCORES = (
    "    if (R > 16 || !vnni_keys(s, D)) return false;\n",
    "    if (R > 16 || !vnni_keys(s, D)) return false;\n"
    "    for (int r = 0; r < R; r++) std::memset(out + (int64_t)r * ls, 0, sizeof(float) * n);\n"
    "    return true;\n",
)
NO_VALUES = (
    "    if (R > 16 || !vnni_values(s, D)) return false;\n",
    "    if (R > 16 || !vnni_values(s, D)) return false;\n    return true;\n",
)
KEYS_IN_L1 = (
    "            transpose((const int32_t*)s.data + first * words, w);",
    "            transpose((const int32_t*)s.data + bh * s.slots * words, w);",
)
VALUES_IN_L1 = (
    "            const uint8_t* base = (const uint8_t*)s.data + first * RB;",
    "            const uint8_t* base = (const uint8_t*)s.data + bh * s.slots * RB;",
)
STRAIGHT = (
    "            transpose((const int32_t*)s.data + first * words, w);",
    "            for (int c = 0; c < NC; c++) w[c] = _mm512_loadu_si512((const int32_t*)s.data + first * words + 16 * c);",
)
ONE_STEP = [
    (
        "            __m512 f = _mm512_setzero_ps();\n            for (int c = 0; c < NC; c++) {",
        "            __m512 f = _mm512_setzero_ps();\n            __m512i all = _mm512_setzero_si512();\n"
        "            for (int c = 0; c < NC; c++) {",
    ),
    (
        "                    acc = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[c], qe), hi[c], qo);\n"
        "                }\n",
        "                    all = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(all, lo[c], qe), hi[c], qo);\n"
        "                    continue;\n                }\n",
    ),
    (
        "            if (book) f = _mm512_sub_ps(f, _mm512_set1_ps(st.offset[r]));",
        "            f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(all), _mm512_set1_ps(st.qa[r][0]), f);\n"
        "            if (book) f = _mm512_sub_ps(f, _mm512_set1_ps(st.offset[r]));",
    ),
]
ONE_FOLD = (
    "            if (g != prep.group) {  // fold this group's scales into the query, its zeros into qz\n",
    "            if (prep.group < 0) {\n",
)
NO_PREFETCH = (
    "        prefetch_rows(s, bh, at.slot, 32, 16, row_bytes, channel ? 0 : 1);  // two chunks ahead\n",
    "",
)
FAR_PREFETCH = (
    "        prefetch_rows(s, bh, at.slot, 32, 16, row_bytes, channel ? 0 : 1);  // two chunks ahead\n",
    "        prefetch_rows(s, bh, at.slot, 512, 16, row_bytes, channel ? 0 : 1);\n",
)
AVX2_ZERO_SCORES = [
    (
        f"    if (R > 16 || !{test}) return false;\n",
        f"    if (R > 16 || !{test}) return false;\n"
        "    for (int r = 0; r < R; r++) std::memset(out + (int64_t)r * ls, 0, sizeof(float) * n);\n"
        "    return true;\n",
    )
    for test in ("int4_keys(s, D)", "int2_keys(s, D)", "fast_kind(s, D, false)")
]
AVX2_NO_VALUES = {
    AVX2_VALUES: [
        (
            "    if (R > 16 || !byte_values(s, D)) return false;\n",
            "    if (R > 16 || !byte_values(s, D)) return false;\n    return true;\n",
        )
    ],
    AVX2_SCORES: [
        (
            "    if (R > 16 || !fast_kind(s, D, true)) return false;\n",
            "    if (R > 16 || !fast_kind(s, D, true)) return false;\n    return true;\n",
        )
    ],
}
AVX2_VARIANTS = {  # file -> its edits, per variant
    "no-scores": {AVX2_SCORES: AVX2_ZERO_SCORES},
    "no-values": AVX2_NO_VALUES,
    "neither": {AVX2_SCORES: AVX2_ZERO_SCORES + AVX2_NO_VALUES[AVX2_SCORES], AVX2_VALUES: AVX2_NO_VALUES[AVX2_VALUES]},
}
KEEP = "        const __mmask16 keep = (__mmask16)((1u << len) - 1);\n"
PLUS = 128  # instructions added per chunk of 16 tokens and KV head: 8 a KV token

# The plus-* variants add PLUS independent instructions of one kind to every 16-token chunk of
# the score kernel, in one asm block the compiler cannot drop or move out of the loop: (the
# instruction, how many accumulators it needs -- 0 for a fresh output each time, else that many
# read-modify-write registers taken in turn so that no chain is longer than PLUS / n).
INJECTED = {
    "plus-valu": ("vpaddd %{x}, %{x}, %{d}", 0),  # a vector integer add
    "plus-shuffle": ("vpshufb %{x}, %{x}, %{d}", 0),  # an in-lane byte shuffle (the nibble tables)
    "plus-permute": ("vpermd %{x}, %{x}, %{d}", 0),  # a cross-lane permute (the transpose's kind)
    "plus-dpbusd": ("vpdpbusd %{x}, %{x}, %{d}", 8),  # the integer dot product
    "plus-fma": ("vfmadd231ps %{x}, %{x}, %{d}", 8),  # a float multiply-add
    "plus-load": ("vmovdqu64 (%{p}), %{d}", 0),  # a 64-byte load that hits L1
    "plus-scalar": ("lea (%{s}, %{s}), %{r}", 0),  # a scalar integer operation
    "plus-nop": ("nop", 0),  # nothing to execute: only the front end, dispatch and retirement
    "plus-chain": ("vpaddd %{x}, %{d}, %{d}", 1),  # one chain of dependent adds: 128 cycles of latency a chunk
}


def injected(kind: str) -> tuple[str, str]:
    """The edit that puts PLUS instructions of `kind` (INJECTED) before the score kernel's heads loop."""
    form, accumulators = INJECTED[kind]
    lines = []
    for j in range(PLUS):
        d = f"a{j % accumulators}" if accumulators else "d"
        lines.append(form.format(x="[x]", d=f"[{d}]", p="[p]", s="[s]", r="[r]"))
    body = "\\n\\t".join(lines)
    if accumulators:
        regs = ", ".join(f"a{k} = lo[0]" for k in range(accumulators))
        outs = ", ".join(f'[a{k}] "+v"(a{k})' for k in range(accumulators))
        block = f'{{ __m512i {regs}; asm volatile("{body}" : {outs} : [x] "v"(lo[1]) : "memory"); }}'
    elif form == "nop":
        block = f'asm volatile("{body}");'
    elif "%{r}" in form:
        block = f'{{ int64_t r; asm volatile("{body}" : [r] "=r"(r) : [s] "r"((int64_t)i) : "memory"); }}'
    else:
        block = f'{{ __m512i d; asm volatile("{body}" : [d] "=v"(d) : [x] "v"(lo[1]), [p] "r"(st.qw) : "memory"); }}'
    return KEEP, f"        {block}\n{KEEP}"


VARIANTS = {
    "no-scores": [ZERO_SCORES],
    "no-values": [NO_VALUES],
    "neither": [ZERO_SCORES, NO_VALUES],
    "keys-in-l1": [KEYS_IN_L1],
    "values-in-l1": [VALUES_IN_L1],
    "no-transpose": [STRAIGHT],
    "one-step": [STRAIGHT, *ONE_STEP],
    "one-fold": [ONE_FOLD],
    "no-prefetch": [NO_PREFETCH],
    "far-prefetch": [FAR_PREFETCH],
    **{kind: [injected(kind)] for kind in INJECTED},
}


def edited(text: str, edits: list[tuple[str, str]], name: str = FILE) -> str:
    """`text` (of the file `name`) with each (old, new) replaced once; an old that is not there
    exactly once stops the run."""
    for old, new in edits:
        if text.count(old) != 1:
            sys.exit(f"{name} no longer has this line once (update bench/attention_bounds.py): {old.strip()[:80]}")
        text = text.replace(old, new)
    return text


def vnni_build(lib: ctypes.CDLL) -> bool:
    """Whether `lib` runs native/vnni_attention.cpp's kernels (built for AVX-512 with VNNI): on
    other CPUs the variants' edits compile away and every ratio would read 1.00."""
    return {"avx512", "avx512_vnni"} <= set(abi.features(lib))


def avx2_build(lib: ctypes.CDLL) -> bool:
    """Whether `lib` runs the AVX2 kernels (avx2_attention.cpp, avx2_int_values.cpp): an AVX2
    build without AVX-512 (with it, the VNNI or float AVX-512 kernels take the rows)."""
    features = set(abi.features(lib))
    return "avx2" in features and "avx512" not in features


def variant_sources(lib: ctypes.CDLL) -> dict[str, dict[str, list[tuple[str, str]]]] | None:
    """Per variant the edits of each source file, for the kernels `lib` runs; None when it runs
    neither the VNNI nor the AVX2 kernels."""
    if vnni_build(lib):
        return {name: {FILE: edits} for name, edits in VARIANTS.items()}
    return AVX2_VARIANTS if avx2_build(lib) else None


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    specs = spec_list(sys.argv[2] if len(sys.argv) > 2 else "fp16;hadv2")
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    tree = backend.library()
    if tree is None:
        sys.exit(f"the kernels are not in use: {backend.describe()}")
    variants = variant_sources(tree)
    if variants is None:
        sys.exit(
            f"the variants edit the AVX-512 VNNI or the AVX2 kernels, which this build does not hold: {backend.describe()}"
        )
    names = sys.argv[4].split(",") if len(sys.argv) > 4 and sys.argv[4] else list(variants)
    unknown = [v for v in names if v not in variants]
    if unknown:
        sys.exit(f"unknown variant {unknown[0]!r} for these kernels: use some of {', '.join(variants)}")
    shape = sys.argv[5] if len(sys.argv) > 5 else "smollm2"  # bench/attention_rounds.py: SHAPES
    layers = Layers(shape, n)
    with tempfile.TemporaryDirectory() as tmp:
        libs: dict[str, ctypes.CDLL] = {"tree": tree}
        for name in names:
            texts = {f: edited((build.HERE / f).read_text(), edits, f) for f, edits in variants[name].items()}
            libs[name] = library_with(texts, Path(tmp) / name, f"variant {name}")
        print(
            f"{backend.describe()}; {shape} layer shape; {n} tokens; {rounds} rounds; median us per layer, and variant/tree per round"
        )
        print(f"{'kv':10s} {'tree':>7s}  " + "  ".join(f"{v:>16s}" for v in names))
        for kv in specs:
            cache = layers.cache(kv)
            plans = {name: layers.plans(lib, cache) for name, lib in libs.items()}
            times: dict[str, list[float]] = {name: [] for name in libs}
            order = list(libs)
            for _ in order:  # a pass through each build first, not counted: pages touched, code loaded
                Layers.seconds(libs[_], plans[_])
            for k in range(rounds):  # each round starts one build later: none is always first
                for name in order[k % len(order) :] + order[: k % len(order)]:
                    times[name].append(Layers.seconds(libs[name], plans[name]) * 1e6)
            cells = []
            for name in names:
                ratio = statistics.median(a / b for a, b in zip(times[name], times["tree"]))
                cells.append(f"{statistics.median(times[name]):7.0f} ({ratio:.2f})")
            print(
                f"{kv:10s} {statistics.median(times['tree']):7.0f}  " + "  ".join(f"{c:>16s}" for c in cells),
                flush=True,
            )


if __name__ == "__main__":
    main()
