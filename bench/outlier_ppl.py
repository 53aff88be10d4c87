"""What exact key outliers would do to perplexity on the cached path, before anyone builds them.

    python bench/outlier_ppl.py hamlet 1          # Hamlet, W 1 (N 896, P 128)
    python bench/outlier_ppl.py --text FILE 4     # any UTF-8 text, W 4

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
lm3ho1 and lm3ho2 keys (one and two outliers a row), and the same for k4v3lmc's keys.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import ClassVar

import torch
from outlier_gauge import round_trip  # bench/ is the script's folder, so on sys.path

from minillama.app.default_model import resolve_model
from minillama.eval.datasets import load as load_text
from minillama.eval.perplexity import evaluate
from minillama.kv.codecs import CODECS, Codebook, PartSpec
from minillama.kv.spec import parse_kv
from minillama.model.loader import load_model


@dataclass(frozen=True)
class WithOutliers(Codebook):
    """A stand-in: lm{bits}h with the k largest |x| of each row kept exact, rows stored decoded."""

    outliers: int = 1
    row_kind: ClassVar = None  # no kernel reads it: the step takes the PyTorch path

    def parts(self, head_dim: int, group: int) -> list[PartSpec]:
        return [PartSpec("values", torch.float32, head_dim, 1)]

    def encode(self, x, group, params=None):
        plain = self.to_space(x.float())  # (B, H, T, D) in the model's space: H is its own inverse
        return {"values": round_trip(CODECS[f"lm{self.bits}h"], plain, self.outliers, group)}

    def decode(self, parts, group, head_dim, params=None):
        return parts["values"].float()


def nominal_bits(bits: int, outliers: int, group: int = 64, head_dim: int = 64) -> float:
    return bits + 16 / group + outliers * (8 + 6) / head_dim


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    windows = int(sys.argv[-1])
    text = open(sys.argv[2], encoding="utf-8").read() if sys.argv[1] == "--text" else load_text(sys.argv[1])
    for b in (3, 4):
        for k in (1, 2):
            CODECS[f"lm{b}ho{k}"] = WithOutliers(f"lm{b}ho{k}", b, "stand-in", rotate=True, outliers=k)
    specs = {
        "fp16": None,
        "k3v2lm": None,
        "k=lm3ho1,v=lm2h,group=64,residual=8,sinks=4": nominal_bits(3, 1),
        "k=lm3ho2,v=lm2h,group=64,residual=8,sinks=4": nominal_bits(3, 2),
        "k4v3lmc": None,
        "k=lm4ho1,v=lm3h,group=64,residual=8,sinks=4,center=1": nominal_bits(4, 1),
    }
    lm = load_model(resolve_model(None), "float32")
    ids = lm.tokenizer.encode(text)
    with torch.inference_mode():
        rows = evaluate(lm, ids, [parse_kv(s) for s in specs], windows=windows, blind=False)
    for r, keys in zip(rows, specs.values()):
        bits = f"keys {keys:.3f} bits (nominal)" if keys else f"{r.bits_per_element:.2f} bits/el"
        print(f"  {r.kv:52s} ppl {r.ppl:.4f}  Δ {r.delta_pct:+.2f}%  KLD {r.kld_mean:.5f}  {bits}", flush=True)


if __name__ == "__main__":
    main()
