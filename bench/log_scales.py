"""What 8-bit log-coded scales would cost the Lloyd-Max codecs, before anyone builds them.

    python bench/log_scales.py hamlet            # Hamlet, W 4 (N 896, P 128)
    python bench/log_scales.py --text FILE       # any UTF-8 text

Issue 28, item 5 (cheaper metadata): an ``lm*`` group of G channels stores one fp16 scale, 16/G
bits per element (0.25 at G = 64). One byte on a logarithmic grid, s = 2^(k/16) for k in
-128..127 (steps of 4.4%, 2^-8 to 2^8), would halve that. This emulates it on the cached path:
the scale refinement of kv/quantize.py rounds every stored scale to that grid instead of to
fp16 (the codes are chosen for the rounded scale, as they are for fp16), the cache keeps that
grid value in its fp16 scale part (rounded once more, by at most 0.05%: far inside the grid's
4.4% steps), and the PyTorch encoder writes the cache (the native one knows only fp16 scales).
It prints the ``ppl`` rows of fp16, k3v2mix, k3v2lm and k4v3lmc both ways, one process, about
4 minutes each way. The bits the byte would save are not
counted by these rows (they report the fp16 scales' bits); read them from the KLD.
"""

from __future__ import annotations

import functools
import sys

import torch

from minillama.app.default_model import resolve_model
from minillama.eval.datasets import load as load_text
from minillama.eval.perplexity import evaluate
from minillama.kv import layered, quantize, write
from minillama.kv.codecs import Codebook
from minillama.kv.spec import parse_kv
from minillama.model.loader import load_model

SPECS = ["fp16", "k3v2mix", "k3v2lm", "k4v3lmc"]


def log8(s: torch.Tensor) -> torch.Tensor:
    """A scale on the 8-bit grid 2^(k/16), k in -128..127 (kv/quantize.py: stored_fp16's stand-in)."""
    k = torch.round(torch.log2(s.float().clamp_min(2.0**-8)) * 16).clamp(-128, 127)
    return torch.exp2(k / 16)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    lm = load_model(resolve_model(None), "float32")
    text = open(sys.argv[2], encoding="utf-8").read() if sys.argv[1] == "--text" else load_text(sys.argv[1])
    ids = lm.tokenizer.encode(text)
    fp16_scales, native = quantize._refined_scale, write.native_encoding
    for name in ("fp16 scales", "8-bit log scales"):
        if name.startswith("8-bit"):  # the PyTorch encoder for Lloyd-Max codecs, with the grid
            quantize._refined_scale = functools.partial(fp16_scales, stored=log8)
            python_codebooks = lambda codec: None if isinstance(codec, Codebook) else native(codec)  # noqa: E731
            write.native_encoding = layered.native_encoding = python_codebooks
        with torch.inference_mode():
            rows = evaluate(lm, ids, [parse_kv(s) for s in SPECS], windows=4, blind=False)
        print(name)
        for r in rows:
            print(f"  {r.kv:10s} ppl {r.ppl:.4f}  Δ {r.delta_pct:+.2f}%  KLD {r.kld_mean:.5f}")
    quantize._refined_scale, write.native_encoding, layered.native_encoding = fp16_scales, native, native


if __name__ == "__main__":
    main()
