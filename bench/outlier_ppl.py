"""What exact key outliers would do to perplexity on the cached path, before anyone builds them.

    python bench/outlier_ppl.py hamlet 1          # Hamlet, W 1 (N 896, P 128)
    python bench/outlier_ppl.py --text FILE 4     # any UTF-8 text, W 4
    python bench/outlier_ppl.py --mix hamlet 4    # the k3v2mix map with one outlier a 2-/3-bit key row

Issue 28, item 3 (dense-and-sparse outliers). bench/outlier_gauge.py measured that one exact
entry per key row cuts a Lloyd-Max code's round-trip error to ~0.67x; this asks what that does
to the next token's prediction. It emulates the codec on the cached path: ``lm{b}ho{k}`` is
lm{b}h whose rows, as they leave the residual window, lose their k largest |x| (in the model's
own space, before the Hadamard rotation), have the rest quantized as lm{b}h quantizes it, and
come back as that decode plus the exact entries. The cache keeps the decoded rows as float32
(so the attention reads exactly what such a codec would decode; the kernels have no route for
this stand-in, so the step runs the PyTorch path), and the bits a real codec would spend are
computed, not counted by the cache: b + 16/64 for codes and scale, + k (8 + 6) / 64 for the
outliers as int8 plus a channel index. The rows printed: fp16, k3v2lm, and k3v2lm with
lm3ho1 and lm3ho2 keys (one and two outliers a row), and the same for k4v3lmc's keys. With
``--mix``: fp16, the per-layer mix k3v2mix (fp16 scales, so the stand-ins match its codecs) and
the same mix with one outlier in every lm2h and lm3h key row (lm4h keys, where one outlier bought
nothing, stay as they are): what the lever adds on top of the allocation, and at what bits.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from outlier_gauge import round_trip  # bench/ is the script's folder, so on sys.path
from standin import DecodedRows, cached_path_rows, text_of

from minillama.kv.codecs import CODECS
from minillama.kv.spec import MIXES


@dataclass(frozen=True)
class WithOutliers(DecodedRows):
    """A stand-in: lm{bits}h with the k largest |x| of each row kept exact, rows stored decoded."""

    outliers: int = 1

    def encode(self, x, group, params=None):
        plain = self.to_space(x.float())  # (B, H, T, D) in the model's space: H is its own inverse
        return {"values": round_trip(CODECS[f"lm{self.bits}h"], plain, self.outliers, group)}


def nominal_bits(bits: int, outliers: int, group: int = 64, head_dim: int = 64) -> float:
    return bits + 16 / group + outliers * (8 + 6) / head_dim


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    args = sys.argv[1:]
    mix = args[0] == "--mix"
    args = args[1:] if mix else args
    windows = int(args[-1])
    text = text_of(args)
    for b in (2, 3, 4):
        for k in (1, 2):
            CODECS[f"lm{b}ho{k}"] = WithOutliers(f"lm{b}ho{k}", b, "stand-in", rotate=True, outliers=k)
    if mix:
        base = MIXES["k3v2mix"]
        head, layers = base.split("layers=")
        pairs = [pair.split("/") for pair in layers.split(";")]
        keyed = [f"{k.replace('lm2h', 'lm2ho1').replace('lm3h', 'lm3ho1')}/{v}" for k, v in pairs]
        extra = sum(k != "lm4h" for k, _ in pairs) * (8 + 6) / 64 / (2 * len(pairs))  # per element of K and V
        specs = {"fp16": None, "k3v2mix": None, head + "layers=" + ";".join(keyed): extra}
    else:
        specs = {
            "fp16": None,
            "k3v2lm": None,
            "k=lm3ho1,v=lm2h,group=64,residual=8,sinks=4": nominal_bits(3, 1),
            "k=lm3ho2,v=lm2h,group=64,residual=8,sinks=4": nominal_bits(3, 2),
            "k4v3lmc": None,
            "k=lm4ho1,v=lm3h,group=64,residual=8,sinks=4,center=1": nominal_bits(4, 1),
        }
    rows = cached_path_rows(list(specs), text, windows)
    mix_bits = next((r.bits_per_element for r in rows if r.kv == "k3v2mix"), 0.0)
    for r, keys in zip(rows, specs.values()):
        if mix and keys:  # the stand-in rows are stored as floats: the mix's own bits plus the outliers'
            bits = f"{mix_bits + keys:.2f} bits/el (nominal: k3v2mix + {keys:.3f})"
        else:
            bits = f"keys {keys:.3f} bits (nominal)" if keys else f"{r.bits_per_element:.2f} bits/el"
        print(f"  {r.kv:52s} ppl {r.ppl:.4f}  Δ {r.delta_pct:+.2f}%  KLD {r.kld_mean:.5f}  {bits}", flush=True)


if __name__ == "__main__":
    main()
