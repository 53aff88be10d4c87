"""Where one layer's integer attention spends its time, by taking parts of the work away.

    python bench/attention_bounds.py 8192 "fp16;hadv2;kivi4;k4v3hc;k3v2lm" 10
    python bench/attention_bounds.py 8192 "hadv2" 10 no-scores,no-values      # only these variants

Each variant is the tree's ``native/vnni_attention.cpp`` with one piece of the integer kernels'
work removed or made free, built as its own library; every spec's 30-layer cache
(``bench/attention_rounds.py: Layers``) is timed through the tree's build and every variant in
turn (each round starting one build later), round after round, and each variant's median per-round ratio to the tree is printed. **A
variant computes wrong attention**: it exists to measure what a piece of the work costs, or
the most a change could buy, never to be used. The variants:

* ``no-scores`` / ``no-values`` / ``neither``: the VNNI score kernel writes zeros / the value
  kernel adds nothing / both; what is left is the driver (softmax, merge, sinks and residual
  parts, thread start and join) and the kernels' absence measures their share of the layer.
* ``keys-in-l1`` / ``values-in-l1``: every block of key (value) rows is read from the head's
  first slots, which stay in L1, instead of its own: the share of the time spent waiting for
  rows to arrive from memory.
* ``no-transpose``: the score kernel loads 16 rows' chunks straight into registers instead of
  transposing them (same bytes, wrong lanes): the most a key layout stored chunk-major, in the
  order the kernel reads it, could buy.
* ``one-step``: ``no-transpose`` and one int8 query step per head instead of one per 8 channels
  (the per-chunk conversions and multiply-adds gone): the most a coarser query contract could
  add to it.
* ``no-prefetch`` / ``far-prefetch``: the score kernel's software prefetch of the key rows
  two 16-row chunks ahead left out, or made 32 chunks ahead: what prefetching buys.

fp16 rows do not go through these kernels: an fp16 spec reads ~1.00 on every variant and
gives the scale (the ratio a quantized spec must reach, 0.40x fp16's layer in issue 26).
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
    "            transpose((const int32_t*)s.data + whole_first * words, rows);",
    "            transpose((const int32_t*)s.data + bh * s.slots * words, rows);",
)
VALUES_IN_L1 = (
    "            const uint8_t* base = (const uint8_t*)s.data + first * RB;",
    "            const uint8_t* base = (const uint8_t*)s.data + bh * s.slots * RB;",
)
STRAIGHT = (
    "            transpose((const int32_t*)s.data + whole_first * words, rows);",
    "            for (int c = 0; c < NC; c++) rows[c] = _mm512_loadu_si512((const int32_t*)s.data + whole_first * words + 16 * c);",
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
NO_PREFETCH = (
    "        prefetch_rows(s, bh, at.slot, 32, 16, row_bytes, channel ? 0 : 1);  // two chunks ahead\n",
    "",
)
FAR_PREFETCH = (
    "        prefetch_rows(s, bh, at.slot, 32, 16, row_bytes, channel ? 0 : 1);  // two chunks ahead\n",
    "        prefetch_rows(s, bh, at.slot, 512, 16, row_bytes, channel ? 0 : 1);\n",
)
VARIANTS = {
    "no-scores": [ZERO_SCORES],
    "no-values": [NO_VALUES],
    "neither": [ZERO_SCORES, NO_VALUES],
    "keys-in-l1": [KEYS_IN_L1],
    "values-in-l1": [VALUES_IN_L1],
    "no-transpose": [STRAIGHT],
    "one-step": [STRAIGHT, *ONE_STEP],
    "no-prefetch": [NO_PREFETCH],
    "far-prefetch": [FAR_PREFETCH],
}


def edited(text: str, edits: list[tuple[str, str]]) -> str:
    """`text` with each (old, new) replaced once; an old that is not there exactly once stops the run."""
    for old, new in edits:
        if text.count(old) != 1:
            sys.exit(f"{FILE} no longer has this line once (update bench/attention_bounds.py): {old.strip()[:80]}")
        text = text.replace(old, new)
    return text


def vnni_build(lib: ctypes.CDLL) -> bool:
    """Whether `lib` runs native/vnni_attention.cpp's kernels (built for AVX-512 with VNNI): on
    other CPUs the variants' edits compile away and every ratio would read 1.00."""
    return {"avx512", "avx512_vnni"} <= set(abi.features(lib))


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    specs = spec_list(sys.argv[2] if len(sys.argv) > 2 else "fp16;hadv2")
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    names = sys.argv[4].split(",") if len(sys.argv) > 4 else list(VARIANTS)
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variant {unknown[0]!r}: use some of {', '.join(VARIANTS)}")
    tree = backend.library()
    if tree is None:
        sys.exit(f"the kernels are not in use: {backend.describe()}")
    if not vnni_build(tree):
        sys.exit(f"the variants edit the AVX-512 VNNI kernels, which this build does not hold: {backend.describe()}")
    source = (build.HERE / FILE).read_text()
    layers = Layers("smollm2", n)
    with tempfile.TemporaryDirectory() as tmp:
        libs: dict[str, ctypes.CDLL] = {"tree": tree}
        for name in names:
            libs[name] = library_with({FILE: edited(source, VARIANTS[name])}, Path(tmp) / name, f"variant {name}")
        print(f"{backend.describe()}; {n} tokens; {rounds} rounds; median us per layer, and variant/tree per round")
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
